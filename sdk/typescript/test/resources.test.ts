/** Templates, builds with live logs, volumes, keys and the caller. */

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { AbortError, ConflictError, NotFoundError } from '../src/index.js';
import { client, sh, SKIP, SLOW, waitFor } from './helpers.js';

const unique = (prefix: string) => `${prefix}-${Math.random().toString(16).slice(2, 10)}`;

describe('me and keys', { skip: SKIP }, () => {
  const clade = client();

  test('me names the key and its workspace', async () => {
    const me = await clade.me();
    assert.equal(me.authMethod, 'token');
    assert.ok(me.workspace.id && me.workspace.name);
    assert.ok(me.key.prefix.startsWith('clade_'));
    assert.equal(me.currentOrg.id, me.workspace.id);
  });

  test('keys are created (with an expiry), listed and revoked', async () => {
    const key = await clade.keys.create({ label: 'ts-sdk', expiresInDays: 30 });
    assert.ok(key.token.startsWith('clade_'));
    assert.equal(key.label, 'ts-sdk');
    const expires = Date.parse(key.expiresAt ?? '');
    assert.ok(Math.abs(expires - (Date.now() + 30 * 86_400_000)) < 3_600_000, `expires_at ${key.expiresAt}`);
    assert.equal((await client({ apiKey: key.token }).me()).key.prefix, key.prefix);
    const listed = (await clade.keys.list()).find((k) => k.prefix === key.prefix);
    assert.ok(listed);
    assert.equal(listed.token ?? undefined, undefined, 'no secret in the listing');
    assert.ok('lastUsedAt' in listed);
    await clade.keys.revoke(key.prefix);
    assert.ok(!(await clade.keys.list()).some((k) => k.prefix === key.prefix));
  });
});

describe('templates', { skip: SKIP }, () => {
  const clade = client();

  test('the global templates are listed and got', async () => {
    const templates = await clade.templates.list();
    const base = templates.find((t) => t.name === 'base');
    assert.ok(base);
    assert.equal(base.isGlobal, true);
    assert.equal((await clade.templates.get('base')).name, 'base');
    await assert.rejects(clade.templates.get('no-such-template'), NotFoundError);
  });

  test('a Dockerfile build streams its log live, ends done, and makes a template', { timeout: 900_000 }, async () => {
    const name = unique('ts-build');
    const build = await clade.templates.build({
      name,
      dockerfile: 'FROM base\nCOPY greeting.txt /etc/greeting\nRUN echo "built by $(whoami)" > /etc/built\n',
      context: { 'greeting.txt': 'hello from the context\n' },
    });
    assert.ok(['queued', 'running'].includes(build.status), build.status);
    assert.equal(build.mode, 'dockerfile');
    const lines: string[] = [];
    for await (const line of clade.templates.builds.logs(build.id)) lines.push(line);
    const log = lines.join('\n');
    assert.match(log, /RUN echo/);
    const done = await clade.templates.builds.wait(build.id);
    assert.equal(done.status, 'done', `${done.error ?? ''}\n${log}`);
    assert.ok((await clade.templates.builds.list()).some((b) => b.id === build.id));
    const template = await clade.templates.get(name);
    assert.equal(template.isGlobal, false);
    {
      await using sb = await clade.sandboxes.create({ template: name });
      assert.equal(await sh(sb, 'cat /etc/greeting /etc/built'), 'hello from the context\nbuilt by root\n');
    }
    await clade.templates.delete(name);
    await assert.rejects(clade.templates.get(name), NotFoundError);
  });
});

describe('template builds, cancelled', { skip: SKIP }, () => {
  const clade = client();

  test('aborting the wait for a build cancels it; cancelling an ended build is a ConflictError', { timeout: 300_000 }, async () => {
    const name = unique('ts-cancel');
    const build = await clade.templates.build({ name, dockerfile: 'FROM base\nRUN sleep 600\n' });
    const controller = new AbortController();
    const waiting = clade.templates.builds.wait(build.id, { signal: controller.signal, intervalMs: 250 });
    await waitFor('the build to run', async () => (await clade.templates.builds.get(build.id)).status === 'running', 120_000);
    controller.abort();
    await assert.rejects(waiting, AbortError);
    const ended = await waitFor('the build to end', async () => {
      const now = await clade.templates.builds.get(build.id);
      return now.status === 'failed' ? now : undefined;
    }, 60_000);
    assert.match(ended.error ?? '', /cancelled/);
    await assert.rejects(clade.templates.builds.cancel(build.id), ConflictError);
    await assert.rejects(clade.templates.get(name), NotFoundError, 'no template was published');
  });
});

describe('volumes', { skip: SKIP }, () => {
  const clade = client();

  test('a volume is created, attached at create (mounted), resized, and deleted', async () => {
    const name = unique('ts-vol');
    const volume = await clade.volumes.create({ name, sizeMb: 64 });
    assert.equal(volume.name, name);
    assert.equal(volume.sizeMb, 64);
    try {
      assert.ok((await clade.volumes.list()).some((v) => v.name === name));
      {
        await using sb = await clade.sandboxes.create({ volumes: [{ name, mountPath: '/data' }] });
        // No sync: deleting the sandbox flushes its volumes.
        await sh(sb, 'echo persisted > /data/file');
        const attached = await clade.volumes.get(name);
        assert.deepEqual(attached.attachments.map((a) => [a.sandboxId, a.mountPath]), [[sb.id, '/data']]);
        await assert.rejects(clade.volumes.delete(name), ConflictError);
      }
      const grown = await clade.volumes.resize(name, 128);
      assert.equal(grown.sizeMb, 128);
      {
        await using sb = await clade.sandboxes.create({ volumes: [{ name, mountPath: '/data', readOnly: true }] });
        assert.equal((await sb.exec('cat /data/file', { timeoutMs: SLOW })).stdout, 'persisted\n');
        assert.notEqual((await sb.exec('touch /data/other', { timeoutMs: SLOW })).exitCode, 0, 'read-only');
      }
    } finally {
      await clade.volumes.delete(name).catch(() => undefined);
    }
    await assert.rejects(clade.volumes.get(name), NotFoundError);
  });
});
