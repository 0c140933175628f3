/** Retries through a loopback proxy: 503 and 429 with Retry-After, and a create whose answer was lost. */

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { ConflictError, RateLimitError, ServiceUnavailableError } from '../src/index.js';
import { client, server, SKIP } from './helpers.js';
import { startProxy } from './proxy.js';

describe('retries', { skip: SKIP }, () => {
  test('503 with Retry-After: 1 is retried after a second, and the call succeeds', async () => {
    const proxy = await startProxy(server.url, { kind: 'refuse', status: 503, times: 2, retryAfter: '1' });
    try {
      const started = Date.now();
      const templates = await client({ baseUrl: proxy.url }).templates.list();
      const waited = Date.now() - started;
      assert.ok(templates.some((t) => t.name === 'base'));
      assert.equal(proxy.seen.length, 3);
      assert.ok(waited >= 1900, `waited ${waited} ms for two Retry-After: 1`);
    } finally {
      await proxy.close();
    }
  });

  test('429 with Retry-After is retried; past the budget the RateLimitError surfaces', async () => {
    const proxy = await startProxy(server.url, { kind: 'refuse', status: 429, times: 1, retryAfter: '1' });
    try {
      const started = Date.now();
      const me = await client({ baseUrl: proxy.url }).me();
      assert.ok(me.workspace.name);
      assert.ok(Date.now() - started >= 950);
      assert.equal(proxy.seen.length, 2);
    } finally {
      await proxy.close();
    }
    const stubborn = await startProxy(server.url, { kind: 'refuse', status: 429, times: 10, retryAfter: '0' });
    try {
      await assert.rejects(client({ baseUrl: stubborn.url, maxRetries: 1 }).me(), RateLimitError);
      assert.equal(stubborn.seen.length, 2, 'one try and one retry');
      await assert.rejects(client({ baseUrl: stubborn.url }).me({ maxRetries: 0 }), RateLimitError);
      assert.equal(stubborn.seen.length, 3, 'maxRetries per call');
    } finally {
      await stubborn.close();
    }
  });

  test('a 409 with Retry-After to a keyed create is retried (its first sending is still being answered); without Retry-After it is not', async () => {
    const admin = client();
    const before = new Set((await admin.sandboxes.list()).map((s) => s.id));
    const proxy = await startProxy(server.url, { kind: 'refuse', status: 409, times: 1, retryAfter: '1', method: 'POST' });
    try {
      const started = Date.now();
      const sb = await client({ baseUrl: proxy.url }).sandboxes.create();
      assert.ok(Date.now() - started >= 950, 'it waited for Retry-After');
      const creates = proxy.seen.filter((r) => r.method === 'POST');
      assert.equal(creates.length, 2);
      assert.equal(creates[0]!.idempotencyKey, creates[1]!.idempotencyKey, 'the same key both times');
      assert.deepEqual((await admin.sandboxes.list()).filter((s) => !before.has(s.id)).map((s) => s.id), [sb.id]);
      await sb.delete();
    } finally {
      await proxy.close();
    }
    const conflict = await startProxy(server.url, { kind: 'refuse', status: 409, times: 1, method: 'POST' });
    try {
      await assert.rejects(client({ baseUrl: conflict.url }).sandboxes.create(), ConflictError);
      assert.equal(conflict.seen.filter((r) => r.method === 'POST').length, 1, 'a plain 409 is not retried');
    } finally {
      await conflict.close();
    }
  });

  test('a POST without an Idempotency-Key (exec) is not retried', async () => {
    await using sb = await client().sandboxes.create();
    const proxy = await startProxy(server.url, { kind: 'refuse', status: 503, times: 1, retryAfter: '0', method: 'POST' });
    try {
      const viaProxy = await client({ baseUrl: proxy.url }).sandboxes.get(sb.id);
      await assert.rejects(viaProxy.exec('true'), ServiceUnavailableError);
      assert.equal(proxy.seen.filter((r) => r.method === 'POST').length, 1);
    } finally {
      await proxy.close();
    }
  });

  test('a create whose answer is lost is retried with the same Idempotency-Key: one sandbox, and the SDK gets it', async () => {
    const admin = client();
    const before = new Set((await admin.sandboxes.list()).map((s) => s.id));
    const proxy = await startProxy(server.url, { kind: 'drop-after-forwarding', method: 'POST', path: '/v1/sandboxes', times: 1 });
    try {
      const sb = await client({ baseUrl: proxy.url }).sandboxes.create({ metadata: { test: 'idempotent' } });
      const creates = proxy.seen.filter((r) => r.method === 'POST' && r.path === '/v1/sandboxes');
      assert.equal(creates.length, 2, 'the create was sent twice');
      assert.ok(creates[0]!.idempotencyKey, 'with an Idempotency-Key');
      assert.equal(creates[0]!.idempotencyKey, creates[1]!.idempotencyKey, 'the same key both times');
      const made = (await admin.sandboxes.list()).filter((s) => !before.has(s.id));
      assert.deepEqual(made.map((s) => s.id), [sb.id], 'exactly one sandbox, the one the SDK got');
      await sb.delete();
    } finally {
      await proxy.close();
    }
  });
});
