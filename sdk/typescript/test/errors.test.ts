/** Errors: one class per status, carrying the server's message, detail and request id. */

import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { join } from 'node:path';
import { describe, test } from 'node:test';
import { APIConnectionError, APIError, AuthenticationError, BadRequestError, Clade, NotFoundError, PermissionDeniedError } from '../src/index.js';
import { client, server, SKIP } from './helpers.js';

describe('errors', { skip: SKIP }, () => {
  const clade = client();

  test('an unknown sandbox is a NotFoundError with the request id in it', async () => {
    await assert.rejects(clade.sandboxes.get('sb-does-not-exist'), (e: unknown) => {
      assert.ok(e instanceof NotFoundError && e instanceof APIError);
      assert.equal(e.status, 404);
      assert.ok(e.requestId, 'a request id');
      assert.ok(e.message.includes(e.requestId!), e.message);
      assert.ok(e.message.startsWith('404 '), e.message);
      return true;
    });
  });

  test("another workspace's sandbox is a NotFoundError, exactly like a missing one", async () => {
    await using sb = await clade.sandboxes.create();
    const other = client({ apiKey: server.otherKey });
    await assert.rejects(other.sandboxes.get(sb.id), NotFoundError);
    await assert.rejects(other.sandboxes.delete(sb.id), NotFoundError);
    assert.equal((await clade.sandboxes.get(sb.id)).id, sb.id);
  });

  test('bad input is a BadRequestError with the server\'s message', async () => {
    await assert.rejects(clade.sandboxes.create({ ttlSeconds: -1 }), (e: unknown) => e instanceof BadRequestError && /ttl_seconds/.test(e.error));
    await assert.rejects(clade.volumes.create({ name: '../bad' }), BadRequestError);
  });

  test('a bad key is an AuthenticationError', async () => {
    await assert.rejects(client({ apiKey: 'clade_not_a_key' }).me(), (e: unknown) => {
      assert.ok(e instanceof AuthenticationError);
      assert.equal(e.error, 'unauthorized');
      return true;
    });
  });

  test('an expired key is an AuthenticationError whose detail says it expired', async () => {
    const key = await clade.keys.create({ label: 'expiring', expiresInDays: 1 });
    assert.ok(key.expiresAt, 'the key has expires_at');
    const ok = await client({ apiKey: key.token }).me();
    assert.equal(ok.key.prefix, key.prefix);
    // Move its expiry to the past in the server's database (the API cannot make an expired key).
    const db = join(server.dataDir, 'clade.db');
    const moved = spawnSync('python3', ['-c', `import sqlite3,sys; c=sqlite3.connect(sys.argv[1]); c.execute("update api_keys set expires_at=1000 where id=?", (sys.argv[2],)); c.commit()`, db, key.id], { encoding: 'utf8' });
    assert.equal(moved.status, 0, moved.stderr);
    await assert.rejects(client({ apiKey: key.token, maxRetries: 0 }).me(), (e: unknown) => {
      assert.ok(e instanceof AuthenticationError, String(e));
      assert.match(e.detail ?? '', /expired/);
      assert.match(e.message, /expired/);
      return true;
    });
    await clade.keys.revoke(key.prefix);
  });

  test('a global template cannot be deleted: PermissionDeniedError', async () => {
    await assert.rejects(clade.templates.delete('base'), PermissionDeniedError);
  });

  test('no server is an APIConnectionError, after the retries', async () => {
    const started = Date.now();
    await assert.rejects(new Clade({ baseUrl: 'http://127.0.0.1:9', apiKey: 'k', maxRetries: 1 }).sandboxes.list(), APIConnectionError);
    assert.ok(Date.now() - started >= 300, 'it waited before retrying');
  });
});
