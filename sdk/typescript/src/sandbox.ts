/**
 * A sandbox: a microVM with its commands, files, code contexts, ports,
 * lifecycle, forks and snapshots. `await using sb = await
 * client.sandboxes.create()` deletes it at the end of the block (unless it
 * was created `persistent`).
 */

import './dispose.js';
import { CommandExitError, NotFoundError, StreamError } from './errors.js';
import { seg, type RequestOptions, type Transport } from './http.js';
import type {
  ChildError,
  ExecBody,
  ExecEvent,
  ExecResult,
  Execution,
  LifecyclePatch,
  LifecycleSettings,
  Limits,
  NetworkPolicy,
  NetworkStatus,
  PromoteResult,
  SandboxEvent,
  SandboxInfo,
  SandboxPatch,
  Snapshot,
} from './models.js';
import { CodeContext, CodeContexts, type Language, type RunCodeOptions } from './resources/code.js';
import { Files } from './resources/files.js';
import { Ports } from './resources/ports.js';
import { linkedController } from './signals.js';
import { parseEvents } from './sse.js';
import { fromWire, toWire } from './wire.js';

export interface ExecOptions extends RequestOptions {
  /**
   * Kill the command (its whole process group) after this long (the
   * server's default: 300 s; whole seconds). The HTTP call gets 30 s more.
   */
  timeoutMs?: number;
  /** Variables added to (and overriding) the sandbox's environment, set verbatim (no shell expansion). */
  env?: Record<string, string>;
  /** The absolute directory it runs in (default: the user's home). */
  cwd?: string;
  /** Throw a {@link CommandExitError} when it exits non-zero. */
  check?: boolean;
}

export interface ForkOptions extends RequestOptions {
  /** How many children (1 by default for fork, 2 for fork-tree); at most 16. */
  count?: number;
  /** The children's metadata. */
  metadata?: Record<string, string>;
}

/** The answer of a fork-tree: the children that started, and why the others did not. */
export interface ForkTree {
  treeId: string | null;
  parentId: string;
  /** RFC 3339: when the parent was captured. */
  at: string;
  children: Sandbox[];
  errors: ChildError[];
}

/** Headroom of the HTTP call over the command's own timeout. */
const COMMAND_TIMEOUT_MARGIN_MS = 30_000;
const SERVER_DEFAULT_COMMAND_TIMEOUT_MS = 300_000;

/** A word for `sh`, single-quoted: for building commands out of untrusted strings. */
export function shellQuote(word: string): string {
  return `'${word.replace(/'/g, `'\\''`)}'`;
}

/** The body of an exec: the server sets `env` verbatim (no shell expansion) and runs in `cwd`. */
function execBody(cmd: string, options: ExecOptions): Record<string, unknown> {
  const body: ExecBody = { cmd, env: options.env, cwd: options.cwd };
  if (options.timeoutMs) body.timeoutSeconds = toSeconds(options.timeoutMs);
  return toWire('ExecBody', body);
}

/** Seconds for the API (whole, at least 1). */
const toSeconds = (ms: number): number => Math.max(1, Math.ceil(ms / 1000));

export class Sandbox implements AsyncDisposable {
  readonly id: string;
  /** What the server said about it last (see {@link refresh}). */
  info: SandboxInfo;
  readonly files: Files;
  readonly ports: Ports;
  readonly codeContexts: CodeContexts;
  /** One context per language for {@link runCode} without a `context`. */
  private readonly defaultContexts = new Map<string, Promise<CodeContext>>();

  constructor(
    private readonly transport: Transport,
    info: SandboxInfo,
  ) {
    this.id = info.id;
    this.info = info;
    this.files = new Files(transport, info.id);
    this.ports = new Ports(transport, info.id);
    this.codeContexts = new CodeContexts(transport, info.id);
  }

  get status(): string {
    return this.info.status;
  }

  get template(): string {
    return this.info.template;
  }

  get metadata(): Record<string, string> {
    return this.info.metadata;
  }

  private get path(): string {
    return `/v1/sandboxes/${seg(this.id)}`;
  }

  private async call<T>(method: 'GET' | 'POST' | 'PUT' | 'PATCH' | 'DELETE', sub: string, options: RequestOptions, json?: unknown): Promise<T> {
    return this.transport.json<T>({ method, path: `${this.path}${sub}`, json }, options);
  }

  /** Fetches its current state into {@link info}. */
  async refresh(options: RequestOptions = {}): Promise<SandboxInfo> {
    this.info = fromWire<SandboxInfo>('Sandbox', await this.call('GET', '', options));
    return this.info;
  }

  /** Changes its settings (`previewAuth`). */
  async update(patch: SandboxPatch, options: RequestOptions = {}): Promise<SandboxInfo> {
    this.info = fromWire<SandboxInfo>('Sandbox', await this.call('PATCH', '', options, toWire('SandboxPatch', patch)));
    return this.info;
  }

  /** Deletes it (its VM, disk and contexts). */
  async delete(options: RequestOptions = {}): Promise<void> {
    await this.call('DELETE', '', options);
  }

  /** Deletes it at the end of an `await using` block, unless it is persistent; already gone is fine. */
  async [Symbol.asyncDispose](): Promise<void> {
    if (this.info.persistent) return;
    try {
      await this.delete();
    } catch (error) {
      if (!(error instanceof NotFoundError)) throw error;
    }
  }

  // ---- commands

  /**
   * Runs `cmd` with `sh -c` to its end. A non-zero exit is a result, not an
   * error, unless `check` is set. Aborting the signal kills the command's
   * process group in the guest.
   */
  async exec(cmd: string, options: ExecOptions = {}): Promise<ExecResult> {
    const json = execBody(cmd, options);
    const httpTimeout = Math.max(this.transport.timeoutMs, (options.timeoutMs ?? SERVER_DEFAULT_COMMAND_TIMEOUT_MS) + COMMAND_TIMEOUT_MARGIN_MS);
    const result = fromWire<ExecResult>('ExecResult', await this.call('POST', '/exec', { ...options, timeoutMs: httpTimeout }, json));
    if (options.check && result.exitCode !== 0) throw new CommandExitError(cmd, result);
    return result;
  }

  /**
   * Runs `cmd`, yielding its output as it comes: `stdout`/`stderr` chunks,
   * then `exit` (or `error`). Breaking out of the loop, or aborting the
   * signal, closes the connection, which kills the command in the guest.
   * With `check`, a non-zero exit throws after its `exit` event.
   */
  execStream(cmd: string, options: ExecOptions = {}): AsyncIterable<ExecEvent> {
    const transport = this.transport;
    const json = execBody(cmd, options);
    const path = `${this.path}/exec/stream`;
    return {
      async *[Symbol.asyncIterator]() {
        const { controller, unlink } = linkedController(options.signal);
        const output = { stdout: '', stderr: '' };
        try {
          const response = await transport.stream(
            { method: 'POST', path, json, accept: 'text/event-stream' },
            { ...options, timeoutMs: undefined, signal: controller.signal },
          );
          for await (const event of parseEvents(response, controller.signal)) {
            const data = JSON.parse(event.data) as { chunk?: string; exit_code?: number; error?: string };
            switch (event.event) {
              case 'stdout':
              case 'stderr':
                if (options.check) output[event.event] += data.chunk ?? '';
                yield { type: event.event, data: data.chunk ?? '' };
                break;
              case 'exit': {
                const exitCode = data.exit_code ?? -1;
                yield { type: 'exit', exitCode };
                if (options.check && exitCode !== 0) throw new CommandExitError(cmd, { exitCode, ...output });
                return;
              }
              case 'error':
                yield { type: 'error', error: data.error ?? 'the command failed' };
                if (options.check) throw new StreamError(data.error ?? 'the command failed');
                return;
            }
          }
          throw new StreamError('the command\'s stream ended before its exit event (did the server stop?)');
        } finally {
          // Closes the connection if the loop ended early: the server kills the command.
          controller.abort();
          unlink();
        }
      },
    };
  }

  // ---- code

  /**
   * Runs a cell in a code context: `context` when given, else this
   * sandbox's default context of `language` (python by default), made on
   * first use, so variables carry over from call to call.
   */
  async runCode(code: string, options: RunCodeOptions & { language?: Language; context?: CodeContext } = {}): Promise<Execution> {
    const context = options.context ?? (await this.defaultContext(options.language ?? 'python', options));
    return context.run(code, options);
  }

  /** {@link runCode}, streamed: output and results as they come, the Execution last. */
  runCodeStream(code: string, options: RunCodeOptions & { language?: Language; context?: CodeContext } = {}) {
    const self = this;
    return {
      async *[Symbol.asyncIterator]() {
        const context = options.context ?? (await self.defaultContext(options.language ?? 'python', options));
        yield* context.runStream(code, options);
      },
    };
  }

  private defaultContext(language: string, options: RequestOptions): Promise<CodeContext> {
    let context = this.defaultContexts.get(language);
    if (!context) {
      context = this.codeContexts.create({ language, signal: options.signal });
      context.catch(() => this.defaultContexts.delete(language));
      this.defaultContexts.set(language, context);
    }
    return context;
  }

  // ---- forks and snapshots

  /** Children that start where it is now (memory, disk, processes): `count` of them (1 by default). */
  async fork(options: ForkOptions = {}): Promise<Sandbox[]> {
    const answer = await this.transport.json<{ children: unknown[] }>(
      { method: 'POST', path: `${this.path}/fork`, json: forkBody(options), idempotent: true },
      options,
    );
    return fromWire<SandboxInfo[]>('Sandbox', answer.children).map((info) => new Sandbox(this.transport, info));
  }

  /** Children in a tree (2 by default) whose metadata names it; one of them is later {@link promote}d. */
  async forkTree(options: ForkOptions = {}): Promise<ForkTree> {
    const answer = await this.transport.json<unknown>(
      { method: 'POST', path: `${this.path}/fork-tree`, json: forkBody(options), idempotent: true },
      options,
    );
    const tree = fromWire<{ treeId?: string | null; parentId: string; at: string; children: SandboxInfo[]; errors: ChildError[] }>('ForkTreeResult', answer);
    return {
      treeId: tree.treeId ?? null,
      parentId: tree.parentId,
      at: tree.at,
      children: tree.children.map((info) => new Sandbox(this.transport, info)),
      errors: tree.errors,
    };
  }

  /** Makes this fork-tree child the tree's winner; `cleanupSiblings` deletes the others. */
  async promote(options: RequestOptions & { cleanupSiblings?: boolean; treeId?: string } = {}): Promise<PromoteResult> {
    const json = toWire('PromoteBody', { cleanupSiblings: options.cleanupSiblings, treeId: options.treeId });
    return fromWire<PromoteResult>('PromoteResult', await this.call('POST', '/promote', options, json));
  }

  /**
   * A snapshot of memory, disk and processes (the sandbox runs on); create from it with `fromSnapshot`,
   * by its id or its `name` (unique in the workspace).
   */
  async snapshot(options: RequestOptions & { name?: string } = {}): Promise<Snapshot> {
    const json = toWire('CreateSnapshotBody', { name: options.name });
    const answer = await this.transport.json({ method: 'POST', path: `${this.path}/snapshots`, idempotent: true, json }, options);
    return fromWire<Snapshot>('Snapshot', answer);
  }

  // ---- lifecycle

  /** Stops its vCPUs, keeping its memory. */
  async pause(options: RequestOptions = {}): Promise<void> {
    await this.call('POST', '/pause', options);
  }

  async resume(options: RequestOptions = {}): Promise<void> {
    await this.call('POST', '/resume', options);
  }

  /**
   * Saves memory and disk and stops the VM; {@link wake} (or any use) restores it.
   * With `memory: false` only the disk is kept: the wake boots it, and what ran is
   * gone (its files, variables, network and volumes stay).
   */
  async hibernate(options: RequestOptions & { memory?: boolean } = {}): Promise<string> {
    const json = options.memory === false ? toWire('HibernateBody', { memory: false }) : undefined;
    return (await this.call<{ status: string }>('POST', '/hibernate', options, json)).status;
  }

  async wake(options: RequestOptions = {}): Promise<string> {
    return (await this.call<{ status: string }>('POST', '/wake', options)).status;
  }

  /** An alias of {@link hibernate}. */
  async stop(options: RequestOptions = {}): Promise<string> {
    return (await this.call<{ status: string }>('POST', '/stop', options)).status;
  }

  /** An alias of {@link wake}. */
  async start(options: RequestOptions = {}): Promise<string> {
    return (await this.call<{ status: string }>('POST', '/start', options)).status;
  }

  /** Its idle settings: TTL, persistence, idle time. */
  async getLifecycle(options: RequestOptions = {}): Promise<LifecycleSettings> {
    return fromWire<LifecycleSettings>('LifecycleSettings', await this.call('GET', '/lifecycle', options));
  }

  /** Changes its idle TTL (seconds; 0: never deleted) or persistence. */
  async setLifecycle(patch: LifecyclePatch, options: RequestOptions = {}): Promise<LifecycleSettings> {
    const settings = fromWire<LifecycleSettings>('LifecycleSettings', await this.call('PATCH', '/lifecycle', options, toWire('LifecyclePatch', patch)));
    this.info = { ...this.info, ttlSeconds: settings.ttlSeconds, persistent: settings.persistent };
    return settings;
  }

  // ---- network and limits

  /** Its egress policy and traffic counters. */
  async getNetwork(options: RequestOptions = {}): Promise<NetworkStatus> {
    return fromWire<NetworkStatus>('NetworkStatus', await this.call('GET', '/network', options));
  }

  /** Replaces its egress policy (in force for the next new connection). */
  async setNetwork(policy: NetworkPolicy, options: RequestOptions = {}): Promise<NetworkStatus> {
    return fromWire<NetworkStatus>('NetworkStatus', await this.call('PUT', '/network', options, toWire('NetworkPolicy', policy)));
  }

  /** The limits of its commands together. */
  async getLimits(options: RequestOptions = {}): Promise<Limits> {
    return fromWire<Limits>('Limits', await this.call('GET', '/limits', options));
  }

  /** Changes the limits of its commands (an absent field is left as it is). */
  async setLimits(limits: Limits, options: RequestOptions = {}): Promise<Limits> {
    return fromWire<Limits>('Limits', await this.call('PUT', '/limits', options, toWire('Limits', limits)));
  }

  // ---- events and logs

  /** Its event log, oldest first (the last `tail`, 1000 by default). */
  async events(options: RequestOptions & { tail?: number } = {}): Promise<SandboxEvent[]> {
    const answer = await this.transport.json<{ events: unknown[] }>({ method: 'GET', path: `${this.path}/events`, query: { tail: options.tail } }, options);
    return fromWire<SandboxEvent[]>('Event', answer.events);
  }

  /** Its events as they happen (after the last `tail`), until it is deleted or the loop ends. */
  followEvents(options: RequestOptions & { tail?: number } = {}): AsyncIterable<SandboxEvent> {
    const request = { method: 'GET' as const, path: `${this.path}/events`, query: { follow: 1, tail: options.tail }, accept: 'text/event-stream' };
    return streamOf(this.transport, request, options, (event) => (event.event === 'event' ? fromWire<SandboxEvent>('Event', JSON.parse(event.data)) : undefined));
  }

  /** Its console (`stdout`), its VMM's errors (`stderr`) or both: the last MiB of each, as text. */
  async logs(options: RequestOptions & { stream?: 'stdout' | 'stderr' | 'both' } = {}): Promise<string> {
    return this.transport.text({ method: 'GET', path: `${this.path}/logs`, query: { stream: options.stream } }, options);
  }

  /** Its log lines as they come, until it is deleted or the loop ends. */
  followLogs(options: RequestOptions & { stream?: 'stdout' | 'stderr' | 'both' } = {}): AsyncIterable<string> {
    const request = { method: 'GET' as const, path: `${this.path}/logs`, query: { follow: 1, stream: options.stream }, accept: 'text/event-stream' };
    return streamOf(this.transport, request, options, (event) => (event.event === 'line' ? String((JSON.parse(event.data) as { line?: string }).line ?? '') : undefined));
  }
}

function forkBody(options: ForkOptions): Record<string, unknown> {
  return toWire('ForkBody', { count: options.count, metadata: options.metadata });
}

/** The items of an SSE answer, mapped by `pick` (undefined: skipped); the connection closes when the loop ends. */
export function streamOf<T>(
  transport: Transport,
  request: Parameters<Transport['stream']>[0],
  options: RequestOptions,
  pick: (event: { event: string; data: string }) => T | undefined,
): AsyncIterable<T> {
  return {
    async *[Symbol.asyncIterator]() {
      const { controller, unlink } = linkedController(options.signal);
      try {
        const response = await transport.stream(request, { ...options, signal: controller.signal });
        for await (const event of parseEvents(response, controller.signal)) {
          const item = pick(event);
          if (item !== undefined) yield item;
        }
      } finally {
        controller.abort();
        unlink();
      }
    },
  };
}
