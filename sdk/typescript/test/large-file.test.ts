/**
 * 2 GiB up and down through streams, on a volume: the bytes come back the
 * same (sha256), nothing holds the file in memory (not the SDK, not this
 * test, and not the server: its peak resident memory, VmHWM, stays flat).
 * CLADE_TEST_LARGE_MIB makes it smaller or larger.
 */

import assert from 'node:assert/strict';
import { createHash, type Hash } from 'node:crypto';
import { readFileSync } from 'node:fs';
import { describe, test } from 'node:test';
import { client, server, SKIP } from './helpers.js';

const MIB = 1 << 20;
const SIZE_MIB = Number(process.env['CLADE_TEST_LARGE_MIB'] ?? 2048);
const VOLUME_MIB = Math.max(64, Math.ceil(SIZE_MIB * 1.5));
/** How much the server's peak memory may grow while the file passes through it. */
const SERVER_GROWTH_LIMIT = 200 * MIB;

/** Deterministic pseudo-random bytes (xorshift32), made a MiB at a time and hashed as they go. */
async function* generated(hash: Hash): AsyncGenerator<Uint8Array> {
  let state = 0x12345678;
  for (let i = 0; i < SIZE_MIB; i++) {
    const chunk = new Uint8Array(MIB);
    const words = new Uint32Array(chunk.buffer);
    for (let w = 0; w < words.length; w++) {
      state ^= state << 13;
      state ^= state >>> 17;
      state ^= state << 5;
      words[w] = state >>> 0;
    }
    hash.update(chunk);
    yield chunk;
  }
}

/** A process's peak resident memory in bytes (VmHWM of /proc/<pid>/status). */
function peakMemory(pid: number): number {
  const line = readFileSync(`/proc/${pid}/status`, 'utf8').split('\n').find((l) => l.startsWith('VmHWM:'));
  const kib = Number(/(\d+)/.exec(line ?? '')?.[1]);
  assert.ok(kib > 0, `no VmHWM for process ${pid}`);
  return kib * 1024;
}

const mb = (bytes: number) => (bytes / 1e6).toFixed(0);
const rate = (bytes: number, ms: number) => (bytes / 1e6 / (ms / 1000)).toFixed(1);

describe('a large file', { skip: SKIP }, () => {
  test(`${SIZE_MIB} MiB go to a volume as a stream and come back as a stream: the same bytes, the server's memory flat`, { timeout: 1_200_000 }, async () => {
    assert.ok(server.pid > 0, 'run.ts passes the server pid');
    const clade = client();
    const name = `ts-large-${Math.random().toString(16).slice(2, 10)}`;
    await clade.volumes.create({ name, sizeMb: VOLUME_MIB });
    try {
      await using sb = await clade.sandboxes.create({ volumes: [{ name, mountPath: '/data' }] });
      const serverBefore = peakMemory(server.pid);
      const ourBefore = process.memoryUsage().rss;

      const sent = createHash('sha256');
      let started = Date.now();
      const written = await sb.files.write('/data/big', generated(sent), { timeoutMs: 1_200_000 });
      const upMs = Date.now() - started;
      assert.equal(written.bytes, SIZE_MIB * MIB);
      const expected = sent.digest('hex');
      assert.equal((await sb.files.stat('/data/big')).size, SIZE_MIB * MIB);

      const received = createHash('sha256');
      let bytes = 0;
      started = Date.now();
      for await (const chunk of await sb.files.read('/data/big', { format: 'stream' })) {
        received.update(chunk);
        bytes += chunk.length;
      }
      const downMs = Date.now() - started;
      const serverAfter = peakMemory(server.pid);
      const ourGrowth = process.memoryUsage().rss - ourBefore;

      console.log(
        `${SIZE_MIB} MiB: up ${rate(SIZE_MIB * MIB, upMs)} MB/s (${(upMs / 1000).toFixed(1)} s), ` +
          `down ${rate(bytes, downMs)} MB/s (${(downMs / 1000).toFixed(1)} s); ` +
          `server VmHWM ${mb(serverBefore)} MB before, ${mb(serverAfter)} MB after; this process grew ${mb(ourGrowth)} MB`,
      );
      assert.equal(bytes, SIZE_MIB * MIB);
      assert.equal(received.digest('hex'), expected, 'the bytes that came back are the bytes sent');
      assert.ok(
        serverAfter - serverBefore < SERVER_GROWTH_LIMIT,
        `the server's peak memory grew by ${mb(serverAfter - serverBefore)} MB (limit ${mb(SERVER_GROWTH_LIMIT)}): it held the file`,
      );
      assert.ok(ourGrowth < SERVER_GROWTH_LIMIT, `this process grew by ${mb(ourGrowth)} MB: the SDK held the file`);
    } finally {
      await clade.volumes.delete(name).catch(() => undefined);
    }
  });
});
