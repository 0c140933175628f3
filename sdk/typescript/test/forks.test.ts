/** Forks, fork-trees and promote; snapshots and sandboxes made from them. */

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { ConflictError, NotFoundError } from '../src/index.js';
import { client, sh, SKIP } from './helpers.js';

describe('forks and snapshots', { skip: SKIP }, () => {
  const clade = client();

  test('fork makes children that start where the parent is', async () => {
    await using parent = await clade.sandboxes.create();
    await sh(parent, 'echo parent > /root/who');
    const children = await parent.fork({ count: 2, metadata: { role: 'child' } });
    try {
      assert.equal(children.length, 2);
      for (const child of children) {
        assert.notEqual(child.id, parent.id);
        assert.equal(child.metadata['role'], 'child');
        assert.equal(await sh(child, 'cat /root/who'), 'parent\n');
      }
      await sh(children[0]!, 'echo changed > /root/who');
      assert.equal(await sh(children[1]!, 'cat /root/who'), 'parent\n', 'children do not share writes');
    } finally {
      await Promise.all(children.map((c) => c.delete()));
    }
  });

  test('a fork-tree child is promoted and its siblings cleaned up', async () => {
    await using parent = await clade.sandboxes.create();
    const tree = await parent.forkTree({ count: 2 });
    assert.equal(tree.children.length, 2);
    assert.deepEqual(tree.errors, []);
    assert.ok(tree.treeId);
    const [winner, loser] = tree.children as [typeof tree.children[0], typeof tree.children[0]];
    const result = await winner.promote({ cleanupSiblings: true });
    assert.equal(result.winner, winner.id);
    assert.equal(result.treeId, tree.treeId);
    assert.deepEqual(result.deleted, [loser.id]);
    await assert.rejects(clade.sandboxes.get(loser.id), NotFoundError);
    await winner.delete();
  });

  test('a snapshot is listed, makes a sandbox with the state, and is deleted', async () => {
    await using sb = await clade.sandboxes.create();
    await sh(sb, 'echo snapshotted > /root/state');
    const snapshot = await sb.snapshot();
    assert.equal(snapshot.sandboxId, sb.id);
    assert.equal(snapshot.snapshotId, snapshot.id);
    assert.ok((await clade.snapshots.list({ sandboxId: sb.id })).some((s) => s.id === snapshot.id));
    assert.equal((await clade.snapshots.get(snapshot.id)).id, snapshot.id);
    {
      await using restored = await clade.sandboxes.create({ fromSnapshot: snapshot.id });
      assert.equal(restored.info.fromSnapshot, snapshot.id);
      assert.equal(await sh(restored, 'cat /root/state'), 'snapshotted\n');
    }
    await clade.snapshots.delete(snapshot.id);
    await assert.rejects(clade.snapshots.get(snapshot.id), NotFoundError);
  });

  test('a named snapshot is found and used by its name', async () => {
    const name = `sdk-ts-${Date.now().toString(36)}`;
    await using sb = await clade.sandboxes.create();
    await sh(sb, 'echo named > /root/state');
    const snapshot = await sb.snapshot({ name });
    assert.equal(snapshot.name, name);
    await assert.rejects(sb.snapshot({ name }), ConflictError);
    assert.deepEqual((await clade.snapshots.list({ name })).map((s) => s.id), [snapshot.id]);
    {
      await using restored = await clade.sandboxes.create({ fromSnapshot: name });
      assert.equal(restored.info.fromSnapshot, snapshot.id);
      assert.equal(await sh(restored, 'cat /root/state'), 'named\n');
    }
    await clade.snapshots.delete(name);
    assert.deepEqual(await clade.snapshots.list({ name }), []);
  });
});
