/**
 * One real `clade server` for the whole suite: started by run.ts before
 * the test files run (each in its own process, as `node --test` does) and
 * handed to them through the environment (see helpers.ts).
 *
 * The binary (`CLADE_BIN`, default target/release/clade) is copied to a
 * temporary file first: the server's binary may be rebuilt while the suite
 * runs. Needs root and QEMU; without them the suite's tests skip with the
 * reason, or fail when `CI` is set.
 */

import { spawn, spawnSync, type ChildProcess } from 'node:child_process';
import { copyFileSync, chmodSync, existsSync, mkdtempSync, openSync, readdirSync, readFileSync, rmSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

export const REPO = process.env['CLADE_REPO'] ?? join(process.cwd(), '..', '..');

export function inCi(): boolean {
  const ci = process.env['CI'] ?? '';
  return !['', '0', 'false'].includes(ci);
}

function binary(): string {
  return process.env['CLADE_BIN'] ?? join(REPO, 'target', 'release', 'clade');
}

/** Why this machine cannot run the server with VMs, or undefined. */
export function missingRequirement(): string | undefined {
  if (process.getuid?.() !== 0) return 'the suite needs root (the server boots QEMU VMs)';
  const qemu = process.env['CLADE_QEMU'] ?? 'qemu-system-x86_64';
  if (spawnSync('sh', ['-c', `command -v ${qemu}`]).status !== 0) return `${qemu} is not installed (scripts/install-host-deps)`;
  if (!existsSync(binary())) return `${binary()} does not exist (scripts/build, or point CLADE_BIN at a clade binary)`;
  return undefined;
}

async function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const probe = createServer();
    probe.once('error', reject);
    probe.listen(0, '127.0.0.1', () => {
      const address = probe.address();
      probe.close(() => (typeof address === 'object' && address ? resolve(address.port) : reject(new Error('no port'))));
    });
  });
}

export interface RunningServer {
  url: string;
  /** The server process (its memory is watched by the large-file test). */
  pid: number;
  adminKey: string;
  otherKey: string;
  dataDir: string;
  bin: string;
  logPath: string;
  /** What the tests created and did not delete: sandboxes, volumes, snapshots, databases, functions and schedules of both workspaces. */
  leftovers(): Promise<string[]>;
  stop(): Promise<void>;
}

export async function startServer(): Promise<RunningServer> {
  const dataDir = mkdtempSync(join(tmpdir(), 'clade-sdk-ts-'));
  const bin = join(dataDir, 'clade-under-test');
  copyFileSync(binary(), bin);
  chmodSync(bin, 0o755);
  const port = await freePort();
  const url = `http://127.0.0.1:${port}`;
  const logPath = join(dataDir, 'server.log');
  const env: NodeJS.ProcessEnv = { ...process.env, NO_COLOR: '1' };
  const guestd = join(REPO, 'target', 'x86_64-unknown-linux-gnu', 'release', 'clade-guestd');
  if (!env['CLADE_GUESTD'] && existsSync(guestd)) env['CLADE_GUESTD'] = guestd;
  const log = openSync(logPath, 'a');
  const child: ChildProcess = spawn(
    bin,
    // The databases' PostgreSQL endpoint on a free port: never another server's 5433.
    // Apps from file:// repositories: apps.test.ts deploys one it makes.
    ['server', '--data-dir', dataDir, '--listen', `127.0.0.1:${port}`, '--standby-horizon', '30', '--db-listen', '127.0.0.1:0', '--apps-allow-file-urls'],
    { stdio: ['ignore', log, log], env, detached: true },
  );
  let exited = false;
  child.once('exit', () => (exited = true));
  const deadline = Date.now() + 90_000;
  for (;;) {
    if (exited) throw new Error(`clade server exited early:\n${tail(logPath)}`);
    try {
      const response = await fetch(`${url}/healthz`);
      if (response.ok) break;
    } catch {
      // not listening yet
    }
    if (Date.now() > deadline) throw new Error(`clade server did not answer /healthz in 90 s:\n${tail(logPath)}`);
    await new Promise((r) => setTimeout(r, 100));
  }
  const adminKey = readFileSync(join(dataDir, 'admin.key'), 'utf8').trim();
  const made = spawnSync(bin, ['keys', 'create', '--workspace', 'other', '--data-dir', dataDir], { env, encoding: 'utf8', timeout: 60_000 });
  if (made.status !== 0) throw new Error(`clade keys create failed: ${made.stderr}`);
  const otherKey = made.stdout.trim().split('\n').pop()!.trim();

  const stop = async () => {
    await deleteAllSandboxes(url, [adminKey, otherKey]).catch(() => undefined);
    if (!exited) {
      child.kill('SIGTERM');
      const stopped = await Promise.race([
        new Promise<boolean>((r) => child.once('exit', () => r(true))),
        new Promise<boolean>((r) => setTimeout(() => r(false), 60_000)),
      ]);
      if (!stopped) child.kill('SIGKILL');
    }
    killProcessesNaming(dataDir, child.pid);
    for (let i = 0; i < 5 && existsSync(dataDir); i++) {
      try {
        if (process.env['CLADE_SDK_KEEP_LOG']) copyFileSync(logPath, process.env['CLADE_SDK_KEEP_LOG']);
        rmSync(dataDir, { recursive: true, force: true });
      } catch {
        await new Promise((r) => setTimeout(r, 500));
      }
    }
  };
  const leftovers = () => listLeftovers(url, [adminKey, otherKey]);
  return { url, pid: child.pid!, adminKey, otherKey, dataDir, bin, logPath, leftovers, stop };
}

async function listLeftovers(url: string, keys: string[]): Promise<string[]> {
  const found: string[] = [];
  for (const key of keys) {
    const get = async (path: string): Promise<unknown> => (await fetch(`${url}${path}`, { headers: { Authorization: `Bearer ${key}` } })).json();
    const sandboxes = (await get('/v1/sandboxes')) as { id: string; metadata?: Record<string, string> }[];
    found.push(...sandboxes.map((s) => `sandbox ${s.id} ${JSON.stringify(s.metadata ?? {})}`));
    const volumes = (await get('/v1/volumes')) as { name: string }[];
    found.push(...volumes.map((v) => `volume ${v.name}`));
    const snapshots = ((await get('/v1/snapshots')) as { snapshots: { id: string }[] }).snapshots;
    found.push(...snapshots.map((s) => `snapshot ${s.id}`));
    const databases = ((await get('/v1/databases')) as { items: { id: string; label?: string }[] }).items;
    found.push(...databases.map((d) => `database ${d.id} ${d.label ?? ''}`.trimEnd()));
    const functions = ((await get('/v1/functions')) as { items: { id: string; name: string }[] }).items;
    found.push(...functions.map((f) => `function ${f.id} ${f.name}`));
    const schedules = ((await get('/v1/schedules')) as { items: { id: string; name: string }[] }).items;
    found.push(...schedules.map((s) => `schedule ${s.id} ${s.name}`));
    const apps = ((await get('/v1/apps')) as { items: { id: string; name: string }[] }).items;
    found.push(...apps.map((a) => `app ${a.id} ${a.name}`));
  }
  return found;
}

async function deleteAllSandboxes(url: string, keys: string[]): Promise<void> {
  for (const key of keys) {
    const headers = { Authorization: `Bearer ${key}` };
    const listed = (await (await fetch(`${url}/v1/sandboxes`, { headers })).json()) as { id: string }[];
    for (const sandbox of listed) await fetch(`${url}/v1/sandboxes/${sandbox.id}`, { method: 'DELETE', headers }).catch(() => undefined);
  }
}

/** SIGKILL to processes whose command line names `directory` (QEMUs the server left), but `exclude`. */
function killProcessesNaming(directory: string, exclude: number | undefined): void {
  for (const entry of readdirSync('/proc')) {
    if (!/^\d+$/.test(entry)) continue;
    const pid = Number(entry);
    if (pid === process.pid || pid === exclude) continue;
    try {
      if (readFileSync(`/proc/${entry}/cmdline`).includes(directory)) process.kill(pid, 'SIGKILL');
    } catch {
      // gone already
    }
  }
}

export function tail(path: string, lines = 60): string {
  try {
    return readFileSync(path, 'utf8').split('\n').slice(-lines).join('\n');
  } catch {
    return '(no log)';
  }
}
