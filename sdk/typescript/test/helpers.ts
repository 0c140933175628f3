/** What the test files share: the server run.ts started, clients of it, small tools. */

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
