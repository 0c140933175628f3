// Fork and pick the best: a sandbox holds a buggy function and its test;
// fork-tree makes N children that start from exactly that state, each tries
// a different fix, the test runs in each, and the first child that passes is
// promoted (its siblings deleted). An agent would propose the fixes; here
// they are listed.
//
//   CLADE_API_URL=http://127.0.0.1:8080 CLADE_API_KEY=clade_… node fork-and-pick-best.mjs

import { Clade } from '@clade/sdk';

const client = new Clade();

const BUGGY = `def average(values):
    return sum(values) / len(values) + 1
`;
const TEST = `from stats import average
assert average([2, 4, 6]) == 4, average([2, 4, 6])
assert average([5]) == 5
print("tests pass")
`;
// Candidate fixes, as sed expressions on stats.py: only one is right.
const FIXES = [
  's|/ len(values) + 1|/ (len(values) + 1)|',
  's|/ len(values) + 1|/ len(values)|',
  's|sum(values)|max(values)|',
];

const parent = await client.sandboxes.create({ metadata: { example: 'fork-and-pick-best' } });
let tree;
try {
  await parent.files.write('/work/stats.py', BUGGY);
  await parent.files.write('/work/test_stats.py', TEST);
  const before = await parent.exec('python3 test_stats.py', { cwd: '/work', timeoutMs: 120_000 });
  console.log(`before: the test exits ${before.exitCode}`);

  tree = await parent.forkTree({ count: FIXES.length });
  const outcomes = await Promise.all(
    tree.children.map(async (child, i) => {
      const fix = FIXES[i];
      await child.exec(`sed -i '${fix}' stats.py`, { cwd: '/work', check: true, timeoutMs: 120_000 });
      const test = await child.exec('python3 test_stats.py', { cwd: '/work', timeoutMs: 120_000 });
      console.log(`child ${i} (${child.id}) tried ${fix}: exit ${test.exitCode}`);
      return { child, fix, passed: test.exitCode === 0 };
    }),
  );

  const best = outcomes.find((o) => o.passed);
  if (!best) throw new Error('no fix made the test pass');
  const promoted = await best.child.promote({ cleanupSiblings: true });
  console.log(`promoted ${promoted.winner} (fix: ${best.fix}); deleted ${promoted.deleted.length} siblings`);
  console.log((await best.child.files.read('/work/stats.py')).trim());
  await best.child.delete();
  console.log(`winner: ${best.fix}`);
} catch (error) {
  // On a failure, leave nothing behind.
  await Promise.all((tree?.children ?? []).map((c) => c.delete().catch(() => undefined)));
  throw error;
} finally {
  await parent.delete();
}
