/**
 * The suite's entry point: starts the shared server, runs the test files
 * with `node --test` (extra arguments go to it), stops the server.
 *
 *   node build/test/run.js [node --test arguments…] [test files…]
 */

import { spawnSync } from 'node:child_process';
import { readdirSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { inCi, missingRequirement, startServer, tail, type RunningServer } from './server.js';

const here = dirname(fileURLToPath(import.meta.url));
const args = process.argv.slice(2);
const files = args.some((a) => a.endsWith('.js'))
  ? []
  : readdirSync(here).filter((f) => f.endsWith('.test.js')).sort().map((f) => join(here, f));

const env: NodeJS.ProcessEnv = { ...process.env };
let server: RunningServer | undefined;
const missing = missingRequirement();
if (missing) {
  if (inCi()) {
    console.error(`required in CI: ${missing}`);
    process.exit(1);
  }
  env['CLADE_TEST_SKIP'] = missing;
} else {
  const started = Date.now();
  server = await startServer();
  console.error(`clade server at ${server.url} (data ${server.dataDir}), up in ${Date.now() - started} ms`);
  Object.assign(env, {
    CLADE_TEST_URL: server.url,
    CLADE_TEST_SERVER_PID: String(server.pid),
    CLADE_TEST_KEY: server.adminKey,
    CLADE_TEST_OTHER_KEY: server.otherKey,
    CLADE_TEST_DATA_DIR: server.dataDir,
    CLADE_TEST_BIN: server.bin,
  });
}

let status = 1;
try {
  const run = spawnSync(process.execPath, ['--test', '--test-reporter=spec', ...args, ...files], { stdio: 'inherit', env });
  status = run.status ?? 1;
  // Every test deletes what it makes: a leftover is a bug of the suite (or of the server's deletes).
  const leftovers = (await server?.leftovers()) ?? [];
  if (leftovers.length > 0) {
    console.error(`\nthe tests left behind (deleted now, with the server):\n  ${leftovers.join('\n  ')}`);
    status ||= 1;
  }
  if (status !== 0 && server) console.error(`\n--- the server's log (tail) ---\n${tail(server.logPath)}`);
} finally {
  await server?.stop();
}
process.exit(status);
