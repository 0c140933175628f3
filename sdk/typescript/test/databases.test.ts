/**
 * Managed PostgreSQL through `client.databases`: a database made and waited
 * for, statements through the HTTP broker, stats and logs, a clone that has
 * the data, a credentials reset that shuts out the old broker token, and
 * deletes; and a create aborted while it waits, which deletes the database
 * it was making. The server's first database bakes the `postgres` template
 * (tens of seconds); later ones are restores (about a second).
 */

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { AbortError, AuthenticationError, BadRequestError, NotFoundError } from '../src/index.js';
import { client, inCi, server, SKIP, waitFor } from './helpers.js';

async function postgresMissing(): Promise<string | undefined> {
  if (SKIP) return SKIP;
  const templates = await client().templates.list();
  if (templates.some((t) => t.name === 'postgres' && t.ready)) return undefined;
  const reason = 'the postgres image is not built (clade images build --image postgres)';
  if (inCi()) throw new Error(`required in CI: ${reason}`);
  return reason;
}

const missing = await postgresMissing();

describe('databases', { skip: missing }, () => {
  const clade = client();

  test('a database is made, queried, cloned, failed over, reset and deleted', { timeout: 600_000 }, async () => {
    const db = await clade.databases.create({ label: 'orders' });
    let cloneId: string | undefined;
    try {
      assert.equal(db.status, 'running');
      assert.equal(db.label, 'orders');
      assert.equal(db.postgresVersion, '15');
      assert.ok(db.connectionUrl?.startsWith('postgresql://clade:'), db.connectionUrl);
      assert.ok(db.brokerToken?.startsWith('pds_pg_'), db.brokerToken);
      assert.equal((await clade.databases.list()).filter((d) => d.id === db.id).length, 1);
      assert.equal((await clade.databases.connection(db.id)).brokerToken, db.brokerToken);

      // Statements through the broker, its token fetched by the SDK.
      const created = await clade.databases.query(db.id, 'CREATE TABLE orders (id int PRIMARY KEY, item text, qty int)');
      assert.equal(created.command, 'CREATE TABLE');
      assert.deepEqual(created.columns, []);
      const inserted = await clade.databases.query(db.id, 'INSERT INTO orders VALUES ($1, $2, $3), ($4, $5, $6)', [1, 'apple', 3, 2, 'pear', 5]);
      assert.equal(inserted.rowCount, 2);
      const selected = await clade.databases.query(db.id, 'SELECT id, item, qty FROM orders WHERE qty > $1 ORDER BY id', [2], {
        brokerToken: db.brokerToken,
      });
      assert.deepEqual(
        selected.columns.map((c) => [c.name, c.typeName]),
        [['id', 'int4'], ['item', 'text'], ['qty', 'int4']],
      );
      assert.deepEqual(selected.rows, [[1, 'apple', 3], [2, 'pear', 5]]);
      assert.equal(selected.rowCount, 2);
      await assert.rejects(clade.databases.query(db.id, 'SELECT * FROM no_such_table'), (e: unknown) => e instanceof BadRequestError && /42P01/.test(e.message));

      const stats = await clade.databases.stats(db.id);
      assert.ok(stats.postgresVersion.startsWith('15.'), stats.postgresVersion);
      assert.ok(stats.dbSizeBytes > 0 && stats.maxConnections > 0, JSON.stringify(stats));
      assert.match(await clade.databases.logs(db.id), /database system is ready to accept connections/);
      assert.equal((await clade.databases.update(db.id, { alwaysOn: true })).alwaysOn, true);
      assert.equal(await clade.databases.wake(db.id), 'running');

      const clone = await clade.databases.clone(db.id);
      cloneId = clone.id;
      assert.equal(clone.status, 'running');
      assert.equal(clone.clonedFrom, db.id);
      assert.equal(clone.label, 'orders (clone)');
      assert.notEqual(clone.password, db.password);
      assert.deepEqual((await clade.databases.query(clone.id, 'SELECT sum(qty) FROM orders')).rows, [[8]]);
      // Failover rebuilds it from its base backup (taken in the background
      // once it is made) and WAL, in a new sandbox, at the same address.
      await waitFor('a base backup', async () => (await clade.databases.get(db.id)).failoverAvailable || undefined, 300_000, 500);
      const rebuilt = await clade.databases.failover(db.id);
      assert.equal(rebuilt.id, db.id);
      assert.notEqual(rebuilt.sandboxId, db.sandboxId);
      assert.equal(rebuilt.connectionUrl, db.connectionUrl);
      assert.deepEqual((await clade.databases.query(db.id, 'SELECT sum(qty) FROM orders')).rows, [[8]]);

      const reset = await clade.databases.resetCredentials(db.id);
      assert.ok(reset.brokerToken && reset.brokerToken !== db.brokerToken);
      assert.notEqual(reset.password, db.password);
      await assert.rejects(clade.databases.query(db.id, 'SELECT 1', [], { brokerToken: db.brokerToken }), AuthenticationError);
      assert.deepEqual((await clade.databases.query(db.id, 'SELECT count(*) FROM orders', [], { brokerToken: reset.brokerToken })).rows, [[2]]);
    } finally {
      for (const id of [cloneId, db.id]) if (id) await clade.databases.delete(id);
    }
    for (const id of [cloneId!, db.id]) await assert.rejects(clade.databases.get(id), NotFoundError);
  });

  test('a create aborted while it waits deletes its database', { timeout: 120_000 }, async () => {
    // In another workspace: a database deleted while it is being made still
    // gets its sandbox, which the server removes a moment later, and the
    // admin workspace's tests count sandboxes.
    // The create is waiting once it polls its database: that is when to abort it.
    let polled: string | undefined;
    const watching = client({
      apiKey: server.otherKey,
      fetch: (input, init) => {
        const url = new URL(input instanceof Request ? input.url : String(input));
        if ((init?.method ?? 'GET') === 'GET' && url.pathname.startsWith('/v1/databases/db-')) polled ??= url.pathname.split('/').pop();
        return fetch(input, init);
      },
    });
    const controller = new AbortController();
    const creating = watching.databases.create({ label: 'aborted' }, { signal: controller.signal });
    const id = await waitFor('the create to poll its database', async () => polled, 60_000, 10);
    controller.abort();
    await assert.rejects(creating, AbortError);
    await assert.rejects(watching.databases.get(id), NotFoundError);
  });
});
