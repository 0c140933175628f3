"""Soak: create → exec → delete cycles from concurrent clients and fork-trees,
through the unmodified SDK against a real server, then a count of everything
a sandbox leaves on the machine: VM processes, network namespaces, host
links (veths), nftables rules, VM and snapshot directories, the server's
open files and memory files, live database rows; and the server's memory.

`test_soak.py` runs a short soak in the suite; `bench/soak` runs the full
one (1,000 cycles from 10 clients and 100 fork-trees of 4) on a server of
its own and prints the figures for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Optional

import pandastack

from conftest import SHARED_SERVER_ARGS, TEMPLATE, processes_under


@dataclasses.dataclass(frozen=True)
class Footprint:
    """What the machine holds for a server's sandboxes, counted."""

    vm_processes: int
    network_namespaces: int
    host_links: int
    nft_rule_lines: int
    vm_dirs: int
    snapshot_dirs: int
    server_fds: int
    server_memory_files: int
    live_sandbox_rows: int

    def grown(self, later: "Footprint") -> Dict[str, tuple]:
        """What `later` holds more of than this: (before, after) by name."""
        return {
            f.name: (getattr(self, f.name), getattr(later, f.name))
            for f in dataclasses.fields(self)
            if getattr(later, f.name) > getattr(self, f.name)
        }


def _count_lines(*cmd: str) -> int:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    return len([line for line in out.stdout.splitlines() if line.strip()])


def _entries(path: Path) -> int:
    try:
        return sum(1 for _ in path.iterdir())
    except FileNotFoundError:
        return 0


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def rss_after_trim(pid: int) -> int:
    """The server's RSS once it has given freed heap memory back (it does
    every 5 s when nothing happens, `HEAP_TRIM_INTERVAL`)."""
    time.sleep(6)
    return rss_kib(pid)


def footprint(client: pandastack.Client, data_dir: Path, server_pid: int) -> Footprint:
    fds = list(Path(f"/proc/{server_pid}/fd").iterdir())
    targets = []
    for fd in fds:
        try:
            targets.append(str(fd.readlink()))
        except OSError:
            pass
    return Footprint(
        vm_processes=len(processes_under(data_dir, server_pid)),
        network_namespaces=_count_lines("ip", "netns", "list"),
        host_links=_count_lines("ip", "-o", "link", "show"),
        nft_rule_lines=_count_lines("nft", "list", "ruleset"),
        vm_dirs=_entries(data_dir / "vms"),
        snapshot_dirs=_entries(data_dir / "snapshots"),
        server_fds=len(targets),
        server_memory_files=sum(1 for t in targets if t.startswith("/memfd:")),
        live_sandbox_rows=len(client.sandboxes.list()),
    )


def settled(client, data_dir: Path, server_pid: int, like: Optional[Footprint] = None, timeout: float = 180) -> Footprint:
    """The footprint once the server is at rest (standby VMMs and prepared
    network slots refilled, a pool grown by a burst shrunk back once the
    burst is past its horizon): no more than `like` in anything, or,
    without it, unchanged for 5 s (a refill under TCG takes a few seconds)."""
    deadline = time.monotonic() + timeout
    last, same_since = footprint(client, data_dir, server_pid), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = footprint(client, data_dir, server_pid)
        if like is not None and not like.grown(now):
            return now
        if now != last:
            last, same_since = now, time.monotonic()
        elif like is None and time.monotonic() - same_since >= 5:
            return now
    return last


@dataclasses.dataclass
class SoakReport:
    cycles: int
    concurrency: int
    trees: int
    tree_size: int
    cycle_seconds: List[float]
    cycles_wall_seconds: float
    tree_seconds: List[float]
    errors: List[str]
    before: Footprint
    after: Footprint
    rss_before_kib: int
    rss_after_kib: int

    @property
    def leftovers(self) -> Dict[str, tuple]:
        return self.before.grown(self.after)

    @property
    def rss_ratio(self) -> float:
        return self.rss_after_kib / max(self.rss_before_kib, 1)

    def lines(self) -> List[str]:
        def p(samples, q):
            ordered = sorted(samples)
            return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] if ordered else 0.0

        out = [
            f"{self.cycles} create → exec → delete cycles from {self.concurrency} clients: "
            f"{self.cycles / self.cycles_wall_seconds:.1f} cycles/s, one cycle p50 {p(self.cycle_seconds, 50) * 1000:.0f} ms, "
            f"p99 {p(self.cycle_seconds, 99) * 1000:.0f} ms",
        ]
        if self.trees:
            out.append(
                f"{self.trees} fork-trees of {self.tree_size} (fork-tree → every child answered → all deleted): "
                f"p50 {statistics.median(self.tree_seconds) * 1000:.0f} ms, p99 {p(self.tree_seconds, 99) * 1000:.0f} ms"
            )
        out.append(f"errors: {len(self.errors)}" + (f" (first: {self.errors[0]})" if self.errors else ""))
        out.append(f"left behind: {self.leftovers or 'nothing'} (counted before → after: {dataclasses.asdict(self.after)})")
        out.append(
            f"server memory (RSS): {self.rss_before_kib / 1024:.1f} MiB after warm-up → {self.rss_after_kib / 1024:.1f} MiB "
            f"after the soak ({self.rss_ratio:.2f}×)"
        )
        return out


def soak(client: pandastack.Client, data_dir: Path, server_pid: int, cycles: int, concurrency: int,
         trees: int, tree_size: int, warmup: int = 10) -> SoakReport:
    errors: List[str] = []

    def cycle() -> float:
        started = time.monotonic()
        sb = client.sandboxes.create(template=TEMPLATE)
        try:
            out = sb.exec("true")
            if out.exit_code != 0:
                errors.append(f"exec in {sb.id}: exit {out.exit_code}")
        finally:
            sb.kill()
        return time.monotonic() - started

    def guarded() -> Optional[float]:
        try:
            return cycle()
        except Exception as e:  # noqa: BLE001 — every failure is a finding, counted and reported
            errors.append(f"{type(e).__name__}: {e}")
            return None

    # Warm-up: the template, the pools and the server's allocator see use first.
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda _: guarded(), range(warmup)))
    errors.clear()
    before = settled(client, data_dir, server_pid)
    rss_before = rss_after_trim(server_pid)

    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        timings = [t for t in pool.map(lambda _: guarded(), range(cycles)) if t is not None]
    wall = time.monotonic() - started

    tree_seconds: List[float] = []
    if trees:
        parent = client.sandboxes.create(template=TEMPLATE)
        try:
            parent.exec("echo parent > /tmp/who")
            for _ in range(trees):
                t0 = time.monotonic()
                try:
                    children = parent.fork_tree(tree_size)
                    for child in children:
                        if child.exec("cat /tmp/who").stdout != "parent\n":
                            errors.append(f"child {child.id} does not see its parent's file")
                    for child in children:
                        child.kill()
                except Exception as e:  # noqa: BLE001
                    errors.append(f"fork-tree: {type(e).__name__}: {e}")
                tree_seconds.append(time.monotonic() - t0)
        finally:
            parent.kill()

    after = settled(client, data_dir, server_pid, like=before)
    return SoakReport(cycles, concurrency, trees, tree_size, timings, wall, tree_seconds, errors, before, after,
                      rss_before, rss_after_trim(server_pid))


def main() -> int:
    from conftest import CladeServer, missing_requirement

    parser = argparse.ArgumentParser(description="Soak a clade server and count what it leaves behind")
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--fork-trees", type=int, default=100)
    parser.add_argument("--tree-size", type=int, default=4)
    args = parser.parse_args()
    reason = missing_requirement()
    if reason:
        print(f"soak: {reason}", file=sys.stderr)
        return 2
    server = CladeServer("soak", args=SHARED_SERVER_ARGS).start()
    try:
        report = soak(server.client(), server.data_dir, server.proc.pid, args.cycles, args.concurrency,
                      args.fork_trees, args.tree_size)
    finally:
        server.teardown(keep_log=False)
    print("\n".join(report.lines()))
    clean = not report.errors and not report.leftovers and report.rss_ratio <= 1.10
    return 0 if clean else 1


if __name__ == "__main__":
    sys.exit(main())
