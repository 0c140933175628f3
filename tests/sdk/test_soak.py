"""Soak without leaks (issue 36), short: 100 create → exec → delete cycles
from 10 concurrent clients and 10 fork-trees of 4, through the unmodified
SDK against the suite's server, leave nothing behind on the machine (see
`soak.py` for what is counted) and the server's memory within 10 % of where
it was after a warm-up. The full soak (1,000 cycles, 100 fork-trees) is
`bench/soak`, with its figures in docs/benchmarks.md.
"""

from soak import soak


def test_a_soak_of_creates_and_fork_trees_leaves_nothing_behind(server, client):
    report = soak(client, server.data_dir, server.proc.pid, cycles=100, concurrency=10, trees=10, tree_size=4)
    print("\n".join(report.lines()))
    assert report.errors == [], report.errors[:5]
    assert len(report.cycle_seconds) == 100
    assert report.leftovers == {}, report.leftovers
    assert report.rss_ratio <= 1.10, report.lines()[-1]
