/** Aborting a call stops its work in the guest: no `sleep 600` is left behind, a cancelled upload replaces nothing. */

import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { AbortError, type Sandbox } from '../src/index.js';
import { client, SKIP, SLOW, waitFor } from './helpers.js';

async function sleepers(sb: Sandbox): Promise<string> {
  return (await sb.exec('pgrep -f "sleep 60[0]" || true', { timeoutMs: SLOW })).stdout.trim();
}

describe('abort', { skip: SKIP }, () => {
  let sb: Sandbox;
  before(async () => {
    sb = await client().sandboxes.create();
  });
  after(async () => {
    await sb?.delete().catch(() => undefined);
  });

  test('aborting a blocking exec kills the command in the guest', async () => {
    const controller = new AbortController();
    const running = sb.exec('sleep 600', { timeoutMs: 900_000, signal: controller.signal });
    await waitFor('sleep 600 to start', async () => (await sleepers(sb)) !== '', 30_000);
    controller.abort();
    await assert.rejects(running, AbortError);
    await waitFor('sleep 600 to be gone', async () => (await sleepers(sb)) === '', 10_000);
  });

  test('aborting a streamed exec kills the command in the guest', async () => {
    const controller = new AbortController();
    const events: string[] = [];
    const consumed = (async () => {
      for await (const event of sb.execStream('echo started; sleep 600', { signal: controller.signal, timeoutMs: 900_000 })) {
        events.push(event.type);
      }
    })();
    await waitFor('sleep 600 to start', async () => (await sleepers(sb)) !== '', 30_000);
    controller.abort();
    await assert.rejects(consumed, AbortError);
    assert.ok(events.every((type) => type === 'stdout'), events.join());
    await waitFor('sleep 600 to be gone', async () => (await sleepers(sb)) === '', 10_000);
  });

  test('breaking out of a streamed exec kills the command too', async () => {
    for await (const event of sb.execStream('echo started; sleep 600')) {
      assert.equal(event.type, 'stdout');
      break;
    }
    await waitFor('sleep 600 to be gone', async () => (await sleepers(sb)) === '', 10_000);
  });

  test('aborting a streamed upload mid-way replaces nothing', async () => {
    await sb.files.write('/root/kept.txt', 'the old contents\n');
    const before = (await sb.files.list('/root')).map((e) => e.name);
    const controller = new AbortController();
    let sent = 0;
    async function* slowBody(): AsyncGenerator<Uint8Array> {
      // 16 MiB, then nothing until the abort: the server has part of a body.
      for (let i = 0; i < 16; i++) {
        sent += 1 << 20;
        yield new Uint8Array(1 << 20).fill(0x61);
      }
      await new Promise((resolve) => controller.signal.addEventListener('abort', resolve, { once: true }));
    }
    const upload = sb.files.write('/root/kept.txt', slowBody(), { signal: controller.signal });
    await waitFor('16 MiB to be sent', async () => sent >= 16 << 20, 30_000, 50);
    await new Promise((r) => setTimeout(r, 1000));
    controller.abort();
    await assert.rejects(upload, AbortError);
    // The server notices the closed connection and the guest drops what it got.
    await new Promise((r) => setTimeout(r, 1000));
    assert.equal(await sb.files.read('/root/kept.txt'), 'the old contents\n');
    await waitFor('no partial file left beside it', async () => {
      const now = (await sb.files.list('/root')).map((e) => e.name);
      return JSON.stringify(now) === JSON.stringify(before);
    }, 10_000);
  });

  test('an already-aborted signal fails at once without a request', async () => {
    await assert.rejects(sb.exec('true', { signal: AbortSignal.abort() }), AbortError);
  });
});
