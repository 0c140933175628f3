/** What the test files share: the server run.ts started, clients of it, small tools. */

import { gzipSync } from 'node:zlib';
import { Clade, type ClientOptions, type Sandbox } from '../src/index.js';
import { inCi, REPO } from './server.js';

export { REPO, inCi };

/** Why the server-backed tests skip (never set in CI: run.ts fails there instead). */
export const SKIP: string | undefined = process.env['CLADE_TEST_SKIP'] ?? (process.env['CLADE_TEST_URL'] ? undefined : 'no server: run the suite with build/test/run.js');
if (SKIP && inCi()) throw new Error(`required in CI: ${SKIP}`);

export const server = {
  url: process.env['CLADE_TEST_URL'] ?? '',
  pid: Number(process.env['CLADE_TEST_SERVER_PID'] ?? 0),
  key: process.env['CLADE_TEST_KEY'] ?? '',
  otherKey: process.env['CLADE_TEST_OTHER_KEY'] ?? '',
  dataDir: process.env['CLADE_TEST_DATA_DIR'] ?? '',
  bin: process.env['CLADE_TEST_BIN'] ?? '',
};

/** A client of the admin workspace (or another key). */
export function client(options: ClientOptions = {}): Clade {
  return new Clade({ baseUrl: server.url, apiKey: server.key, ...options });
}

/** Commands get generous timeouts: the machine is small and emulates the VMs (TCG). */
export const SLOW = 120_000;

export async function waitFor<T>(what: string, probe: () => Promise<T | undefined | false>, timeoutMs = 30_000, intervalMs = 250): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await probe();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await new Promise((r) => setTimeout(r, intervalMs));
  }
}

/** Runs `cmd` and returns its stdout, failing the test on a non-zero exit. */
export async function sh(sb: Sandbox, cmd: string): Promise<string> {
  return (await sb.exec(cmd, { check: true, timeoutMs: SLOW })).stdout;
}

/**
 * A tar.gz of `files` (relative path → content): ustar headers written by
 * hand (regular files only, names under 100 bytes), so the suite needs no
 * tar package.
 */
export function tarGz(files: Record<string, string | Uint8Array>): Uint8Array {
  const blocks: Uint8Array[] = [];
  const ascii = (block: Uint8Array, offset: number, text: string) => block.set(new TextEncoder().encode(text), offset);
  const octal = (value: number, width: number) => `${value.toString(8).padStart(width - 1, '0')}\0`;
  for (const [name, content] of Object.entries(files)) {
    const data = typeof content === 'string' ? new TextEncoder().encode(content) : content;
    if (new TextEncoder().encode(name).length >= 100) throw new Error(`tar entry ${name}: a name under 100 bytes`);
    const header = new Uint8Array(512);
    ascii(header, 0, name);
    ascii(header, 100, octal(0o644, 8));
    ascii(header, 108, octal(0, 8));
    ascii(header, 116, octal(0, 8));
    ascii(header, 124, octal(data.length, 12));
    ascii(header, 136, octal(Math.floor(Date.now() / 1000), 12));
    ascii(header, 148, '        '); // the checksum counts its own field as spaces
    ascii(header, 156, '0');
    ascii(header, 257, 'ustar\0' + '00');
    const sum = header.reduce((total, byte) => total + byte, 0);
    ascii(header, 148, `${sum.toString(8).padStart(6, '0')}\0 `);
    blocks.push(header, data, new Uint8Array((512 - (data.length % 512)) % 512));
  }
  blocks.push(new Uint8Array(1024));
  return new Uint8Array(gzipSync(Buffer.concat(blocks)));
}
