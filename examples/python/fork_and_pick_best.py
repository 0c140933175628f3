"""Best-of-N with forks: a sandbox holds a buggy function and its test;
N children forked from it each try a different fix and run the test; the
first child that passes is promoted (its siblings deleted), and the parent
goes away. Forks are copy-on-write snapshots of the running sandbox, so
each child starts from exactly the parent's state.

    CLADE_API_URL=http://127.0.0.1:8080 CLADE_API_KEY=clade_... python3 fork_and_pick_best.py
"""

from __future__ import annotations

import sys

from clade import Clade, Sandbox

BUGGY = """\
def average(values):
    return sum(values) / (len(values) - 1)
"""

TEST = """\
from calc import average
assert average([2, 4, 6]) == 4, average([2, 4, 6])
assert average([5]) == 5
print("tests pass")
"""

# What each child tries: a replacement for the buggy line.
CANDIDATE_FIXES = [
    "    return sum(values) / (len(values) + 1)",
    "    return sum(values) / len(values)",
    "    return sum(values) // (len(values) - 1)",
]


def try_fix(child: Sandbox, fix: str) -> bool:
    source = child.files.read_text("/root/app/calc.py").splitlines()
    source[1] = fix
    child.files.write("/root/app/calc.py", "\n".join(source) + "\n")
    result = child.exec("python3 test_calc.py", cwd="/root/app", timeout=120)
    print(f"  {child.id}: {fix.strip()!r} -> exit {result.exit_code}")
    return result.exit_code == 0


def main() -> int:
    with Clade() as client, client.sandboxes.create("base") as parent:
        parent.files.write("/root/app/calc.py", BUGGY)
        parent.files.write("/root/app/test_calc.py", TEST)
        before = parent.exec("python3 test_calc.py", cwd="/root/app", timeout=120)
        print(f"parent {parent.id}: the test fails first (exit {before.exit_code})")

        tree = parent.fork_tree(count=len(CANDIDATE_FIXES))
        winner = None
        for child, fix in zip(tree.children, CANDIDATE_FIXES):
            if winner is None and try_fix(child, fix):
                winner = child
        if winner is None:
            for child in tree.children:
                child.delete()
            print("no candidate fixed the bug", file=sys.stderr)
            return 1

        promoted = winner.promote(cleanup_siblings=True)
        print(f"winner {promoted.winner}; deleted its siblings {sorted(promoted.deleted)}")
        print(winner.files.read_text("/root/app/calc.py"))
        winner.delete()
    return 0


if __name__ == "__main__":
    sys.exit(main())
