/** A sandbox through the SDK: create, commands, files, ports, network, limits, events, logs, lifecycle, disposal. */

import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { BadRequestError, CommandExitError, NotFoundError, type ExecEvent, type Sandbox } from '../src/index.js';
import { client, sh, SKIP, SLOW, waitFor } from './helpers.js';

describe('a sandbox', { skip: SKIP }, () => {
  const clade = client();
  let sb: Sandbox;

  before(async () => {
    sb = await clade.sandboxes.create({ template: 'base', metadata: { suite: 'ts', owner_name: 'me' }, ttlSeconds: 3600 });
  });
  after(async () => {
    await sb?.delete().catch(() => undefined);
  });

  test('is created running, with its metadata keys as given (camelCase fields, snake_case map keys kept)', async () => {
    assert.equal(sb.status, 'running');
    assert.equal(sb.template, 'base');
    assert.deepEqual(sb.metadata, { suite: 'ts', owner_name: 'me' });
    assert.equal(sb.info.ttlSeconds, 3600);
    assert.equal(typeof sb.info.createdAt, 'string');
    const again = await clade.sandboxes.get(sb.id);
    assert.equal(again.id, sb.id);
    assert.ok((await clade.sandboxes.list()).some((s) => s.id === sb.id));
    const info = await sb.refresh();
    assert.ok(info.disk && info.disk.sizeBytes > 0, 'get answers the disk');
  });

  test('exec returns a typed result; a non-zero exit is a result unless check is set', async () => {
    const result = await sb.exec('echo out; echo err >&2; exit 3', { timeoutMs: SLOW });
    assert.equal(result.stdout, 'out\n');
    assert.equal(result.stderr, 'err\n');
    assert.equal(result.exitCode, 3);
    assert.equal(typeof result.durationMs, 'number');
    await assert.rejects(sb.exec('echo nope >&2; exit 4', { check: true, timeoutMs: SLOW }), (e: unknown) => {
      assert.ok(e instanceof CommandExitError);
      assert.equal(e.exitCode, 4);
      assert.equal(e.stderr, 'nope\n');
      assert.match(e.message, /exited with code 4/);
      return true;
    });
  });

  test('exec takes env (set verbatim, never shell-expanded) and cwd; a relative cwd is a BadRequestError', async () => {
    const env = { GREETING: "it's $HOME `id`", OTHER: 'a b' };
    const out = await sb.exec('echo "$GREETING $OTHER"; pwd', { env, cwd: '/tmp', timeoutMs: SLOW });
    assert.equal(out.stdout, "it's $HOME `id` a b\n/tmp\n");
    const events: ExecEvent[] = [];
    for await (const event of sb.execStream('echo "$GREETING"; pwd', { env, cwd: '/etc' })) events.push(event);
    const streamed = events.flatMap((e) => (e.type === 'stdout' ? [e.data] : [])).join('');
    assert.equal(streamed, "it's $HOME `id`\n/etc\n");
    await assert.rejects(sb.exec('pwd', { cwd: 'tmp' }), (e: unknown) => e instanceof BadRequestError && /cwd/.test(e.error));
  });

  test('execStream yields stdout and stderr chunks in order, then exit', async () => {
    const events: ExecEvent[] = [];
    for await (const event of sb.execStream('for i in 1 2 3; do echo "line $i"; sleep 0.2; done; echo done >&2; exit 7', { timeoutMs: SLOW })) {
      events.push(event);
    }
    const stdout = events.flatMap((e) => (e.type === 'stdout' ? [e.data] : [])).join('');
    assert.equal(stdout, 'line 1\nline 2\nline 3\n');
    assert.ok(events.filter((e) => e.type === 'stdout').length >= 2, 'output came in several chunks, as it was written');
    const last = events.at(-1);
    assert.deepEqual(last, { type: 'exit', exitCode: 7 });
    const stderrAt = events.findIndex((e) => e.type === 'stderr');
    const lastStdoutAt = events.map((e) => e.type).lastIndexOf('stdout');
    assert.ok(stderrAt > lastStdoutAt, 'stderr came after the stdout written before it');
  });

  test('execStream with check throws after a non-zero exit', async () => {
    await assert.rejects(async () => {
      for await (const _ of sb.execStream('echo x; exit 5', { check: true })) void _;
    }, (e: unknown) => e instanceof CommandExitError && e.exitCode === 5 && e.stdout === 'x\n');
  });

  test('files: write and read text and bytes, list, stat, exists, remove', async () => {
    const written = await sb.files.write('/root/dir/hello.txt', 'héllo\n');
    assert.deepEqual(written, { path: '/root/dir/hello.txt', bytes: 7 });
    assert.equal(await sb.files.read('/root/dir/hello.txt'), 'héllo\n');
    const binary = new Uint8Array(256).map((_, i) => i);
    await sb.files.write('/root/dir/bin', binary);
    assert.deepEqual(await sb.files.read('/root/dir/bin', { format: 'bytes' }), binary);
    const entries = await sb.files.list('/root/dir');
    assert.deepEqual(entries.map((e) => [e.name, e.isDir, e.size]), [['bin', false, 256], ['hello.txt', false, 7]]);
    const stat = await sb.files.stat('/root/dir');
    assert.equal(stat.isDir, true);
    assert.equal(stat.mode, 'd');
    assert.equal(await sb.files.exists('/root/dir/bin'), true);
    await sb.files.remove('/root/dir');
    assert.equal(await sb.files.exists('/root/dir/bin'), false);
    await assert.rejects(sb.files.read('/root/dir/bin'), NotFoundError);
  });

  test('files: an AsyncIterable and a ReadableStream upload; a stream download', async () => {
    async function* parts() {
      for (let i = 0; i < 5; i++) yield new TextEncoder().encode(`part ${i}\n`);
    }
    await sb.files.write('/root/parts.txt', parts());
    assert.equal(await sh(sb, 'cat /root/parts.txt'), 'part 0\npart 1\npart 2\npart 3\npart 4\n');
    const stream = new ReadableStream<Uint8Array>({
      start(controller) {
        controller.enqueue(new TextEncoder().encode('from a '));
        controller.enqueue(new TextEncoder().encode('web stream'));
        controller.close();
      },
    });
    await sb.files.write('/root/web.txt', stream);
    const read = await sb.files.read('/root/web.txt', { format: 'stream' });
    let text = '';
    for await (const chunk of read) text += new TextDecoder().decode(chunk);
    assert.equal(text, 'from a web stream');
  });

  test('files: upload from and download to local paths', async () => {
    const { mkdtempSync, writeFileSync, readFileSync } = await import('node:fs');
    const { join } = await import('node:path');
    const dir = mkdtempSync('/tmp/clade-ts-files-');
    writeFileSync(join(dir, 'in.txt'), 'local file\n');
    await sb.files.upload(join(dir, 'in.txt'), '/root/in.txt');
    const got = await sb.files.download('/root/in.txt', join(dir, 'out.txt'));
    assert.equal(got.bytes, 11);
    assert.equal(readFileSync(join(dir, 'out.txt'), 'utf8'), 'local file\n');
  });

  test('ports: listening ones are listed with their preview URL; labels are added and removed; preview tokens', async () => {
    await sb.exec('nohup python3 -m http.server 8123 >/dev/null 2>&1 &', { timeoutMs: SLOW });
    const port = await waitFor('port 8123 to listen', async () => (await sb.ports.list()).find((p) => p.port === 8123 && p.listening));
    assert.match(port.previewUrl, new RegExp(`8123-${sb.id}`));
    assert.equal(await sb.ports.previewUrl(8123), port.previewUrl);
    const labelled = await sb.ports.add(9000, { label: 'later' });
    assert.equal(labelled.label, 'later');
    assert.equal(labelled.source, 'user');
    await sb.ports.remove(9000);
    assert.ok(!(await sb.ports.list()).some((p) => p.port === 9000));
    const token = await sb.ports.createPreviewToken({ port: 8123, ttlSeconds: 60 });
    assert.ok(token.token.length > 10);
    assert.equal(token.port, 8123);
    const updated = await sb.update({ previewAuth: true });
    assert.equal(updated.previewAuth, true);
  });

  test('network policy and limits are read and set', async () => {
    const status = await sb.getNetwork();
    assert.equal(typeof status.enabled, 'boolean');
    if (status.enabled) {
      const set = await sb.setNetwork({ internet: false, allowCidrs: ['10.1.2.0/24'], maxConnections: 64 });
      assert.equal(set.policy?.internet, false);
      assert.deepEqual(set.policy?.allowCidrs, ['10.1.2.0/24']);
      assert.equal(set.policy?.maxConnections, 64);
    }
    const limits = await sb.setLimits({ maxProcesses: 300 });
    assert.equal(limits.maxProcesses, 300);
    assert.equal((await sb.getLimits()).maxProcesses, 300);
  });

  test('events and logs', async () => {
    const events = await sb.events({ tail: 50 });
    assert.ok(events.some((e) => e.type === 'created'), JSON.stringify(events.map((e) => e.type)));
    assert.ok(events.every((e) => e.sandboxId === sb.id));
    const logs = await sb.logs({ stream: 'stdout' });
    assert.equal(typeof logs, 'string');
    // Following: the next event (an exec) arrives live; leaving the loop closes the stream.
    const seen = (async () => {
      for await (const event of sb.followEvents({ tail: 0 })) {
        if (event.type === 'exec') return event;
      }
      return undefined;
    })();
    await new Promise((r) => setTimeout(r, 500));
    await sb.exec('true', { timeoutMs: SLOW });
    const event = await seen;
    assert.equal(event?.type, 'exec');
  });
});

describe('lifecycle', { skip: SKIP }, () => {
  const clade = client();

  test('pause/resume, hibernate/wake, stop/start, and the idle settings', async () => {
    await using sb = await clade.sandboxes.create();
    await sb.exec('echo kept > /root/state', { timeoutMs: SLOW });
    await sb.pause();
    assert.equal((await sb.refresh()).status, 'paused');
    await sb.resume();
    assert.equal((await sb.refresh()).status, 'running');
    assert.equal(await sb.hibernate(), 'hibernated');
    assert.equal(await sb.wake(), 'running');
    assert.equal(await sb.stop(), 'hibernated');
    assert.equal(await sb.start(), 'running');
    assert.equal(await sh(sb, 'cat /root/state'), 'kept\n');
    const settings = await sb.setLifecycle({ ttlSeconds: 1234 });
    assert.equal(settings.ttlSeconds, 1234);
    assert.equal((await sb.getLifecycle()).ttlSeconds, 1234);
    const hibernating = await sb.setLifecycle({ hibernateAfterSeconds: 120 });
    assert.equal(hibernating.hibernateAfterSeconds, 120);
    assert.equal(hibernating.hibernateMemory, true);
    assert.equal((await sb.setLifecycle({ hibernateMemory: false })).hibernateMemory, false);
    // Disk only: the wake boots the disk, the files stay.
    const bootId = await sh(sb, 'cat /proc/sys/kernel/random/boot_id');
    assert.equal(await sb.hibernate({ memory: false }), 'hibernated');
    assert.equal(await sb.wake(), 'running');
    assert.notEqual(await sh(sb, 'cat /proc/sys/kernel/random/boot_id'), bootId);
    assert.equal(await sh(sb, 'cat /root/state'), 'kept\n');
  });
});

describe('await using', { skip: SKIP }, () => {
  const clade = client();

  test('deletes the sandbox at the end of the block', async () => {
    let id = '';
    {
      await using sb = await clade.sandboxes.create();
      id = sb.id;
      assert.equal((await sb.exec('echo hi', { timeoutMs: SLOW })).stdout, 'hi\n');
    }
    await assert.rejects(clade.sandboxes.get(id), NotFoundError);
  });

  test('deletes it also when the block throws', async () => {
    let id = '';
    await assert.rejects(async () => {
      await using sb = await clade.sandboxes.create();
      id = sb.id;
      throw new Error('boom');
    }, /boom/);
    assert.ok(id);
    await assert.rejects(clade.sandboxes.get(id), NotFoundError);
  });

  test('keeps a persistent sandbox', async () => {
    let id = '';
    {
      await using sb = await clade.sandboxes.create({ persistent: true });
      id = sb.id;
    }
    const kept = await clade.sandboxes.get(id);
    assert.equal(kept.info.persistent, true);
    await kept.delete();
  });
});
