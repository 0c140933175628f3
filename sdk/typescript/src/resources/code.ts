/**
 * Code contexts (`/v1/sandboxes/{id}/repl/sessions`): persistent Python
 * (Jupyter), JavaScript, TypeScript and bash interpreters in a sandbox,
 * run cell by cell, with rich results (MIME bundles: charts, tables).
 */

import { decodeBase64 } from '../bytes.js';
import { StreamError } from '../errors.js';
import { seg, type RequestOptions, type Transport } from '../http.js';
import type { CodeContextInfo, CodeEvent, CodeResult, Execution } from '../models.js';
import { linkedController } from '../signals.js';
import { parseEvents } from '../sse.js';
import { fromWire } from '../wire.js';

export type Language = 'python' | 'javascript' | 'typescript' | 'bash' | (string & {});

export interface RunCodeOptions extends RequestOptions {
  /**
   * Interrupt the cell after this long (the server's default: 30 s); the
   * context keeps its state. The HTTP call gets 30 s more.
   */
  timeoutMs?: number;
}

/** Headroom of the HTTP call over the cell's own timeout. */
const CELL_TIMEOUT_MARGIN_MS = 30_000;
const DEFAULT_CELL_TIMEOUT_MS = 30_000;

export class CodeContexts {
  constructor(
    private readonly transport: Transport,
    private readonly sandboxId: string,
  ) {}

  private get path(): string {
    return `/v1/sandboxes/${seg(this.sandboxId)}/repl/sessions`;
  }

  /** A new context (`python` by default; `cwd` its working directory). */
  async create(options: RequestOptions & { language?: Language; cwd?: string } = {}): Promise<CodeContext> {
    const json: Record<string, string> = {};
    if (options.language) json['language'] = options.language;
    if (options.cwd) json['cwd'] = options.cwd;
    const info = fromWire<CodeContextInfo>('CodeContext', await this.transport.json({ method: 'POST', path: this.path, json }, options));
    return new CodeContext(this.transport, info);
  }

  /** The sandbox's contexts, with their cell counts and liveness. */
  async list(options: RequestOptions = {}): Promise<CodeContextInfo[]> {
    return fromWire<CodeContextInfo[]>('CodeContext', await this.transport.json({ method: 'GET', path: this.path }, options));
  }

  /** Ends a context (its kernel stops). */
  async delete(contextId: string, options: RequestOptions = {}): Promise<void> {
    await this.transport.json({ method: 'DELETE', path: `${this.path}/${seg(contextId)}` }, options);
  }
}

/** One context: its variables live from cell to cell. */
export class CodeContext {
  readonly id: string;
  readonly sandboxId: string;
  readonly language: string;

  constructor(
    private readonly transport: Transport,
    readonly info: CodeContextInfo,
  ) {
    this.id = info.id;
    this.sandboxId = info.sandboxId;
    this.language = info.language;
  }

  private get path(): string {
    return `/v1/sandboxes/${seg(this.sandboxId)}/repl/sessions/${seg(this.id)}/run`;
  }

  private body(code: string, options: RunCodeOptions): Record<string, unknown> {
    return options.timeoutMs ? { code, timeout_ms: Math.ceil(options.timeoutMs) } : { code };
  }

  /** The HTTP call outlasts the cell's own timeout. */
  private httpTimeout(options: RunCodeOptions): number {
    return Math.max(this.transport.timeoutMs, (options.timeoutMs ?? DEFAULT_CELL_TIMEOUT_MS) + CELL_TIMEOUT_MARGIN_MS);
  }

  /** Runs a cell to its end. Aborting the signal interrupts the cell (the context lives on). */
  async run(code: string, options: RunCodeOptions = {}): Promise<Execution> {
    const answer = await this.transport.json<WireExecution>(
      { method: 'POST', path: this.path, json: this.body(code, options) },
      { ...options, timeoutMs: this.httpTimeout(options) },
    );
    return toExecution(answer);
  }

  /**
   * Runs a cell, yielding its output as it comes and its Execution last.
   * Leaving the loop early closes the connection, which interrupts the cell.
   */
  runStream(code: string, options: RunCodeOptions = {}): AsyncIterable<CodeEvent> {
    const transport = this.transport;
    const request = { method: 'POST' as const, path: this.path, json: this.body(code, options), accept: 'text/event-stream' };
    return {
      async *[Symbol.asyncIterator]() {
        const { controller, unlink } = linkedController(options.signal);
        try {
          const response = await transport.stream(request, { ...options, timeoutMs: undefined, signal: controller.signal });
          for await (const event of parseEvents(response, controller.signal)) {
            const data = JSON.parse(event.data) as Record<string, unknown>;
            switch (event.event) {
              case 'stdout':
              case 'stderr':
                yield { type: event.event, text: String(data['text'] ?? '') };
                break;
              case 'result':
                yield { type: 'result', result: toCodeResult(data as Record<string, string>) };
                break;
              case 'error':
                if (typeof data['error'] === 'string' && !('name' in data)) throw new StreamError(`the cell failed: ${data['error']}`);
                yield { type: 'error', name: String(data['name'] ?? ''), value: String(data['value'] ?? ''), traceback: String(data['traceback'] ?? '') };
                break;
              case 'execution':
                yield { type: 'execution', execution: toExecution(data as unknown as WireExecution) };
                return;
            }
          }
          throw new StreamError('the cell\'s stream ended before its execution event');
        } finally {
          controller.abort();
          unlink();
        }
      },
    };
  }

  /** Ends the context. */
  async delete(options: RequestOptions = {}): Promise<void> {
    await this.transport.json({ method: 'DELETE', path: `/v1/sandboxes/${seg(this.sandboxId)}/repl/sessions/${seg(this.id)}` }, options);
  }
}

interface WireExecution {
  stdout: string;
  stderr: string;
  exit?: number;
  exit_code: number;
  duration_ms: number;
  error?: string | null;
  results: Record<string, string>[];
  truncated?: boolean;
}

function toExecution(wire: WireExecution): Execution {
  return {
    stdout: wire.stdout,
    stderr: wire.stderr,
    exitCode: wire.exit_code ?? wire.exit ?? 0,
    durationMs: wire.duration_ms,
    error: wire.error ?? null,
    results: (wire.results ?? []).map(toCodeResult),
    truncated: wire.truncated ?? false,
  };
}

/** A MIME bundle with its common formats decoded (images from base64, JSON parsed). */
export function toCodeResult(bundle: Record<string, string>): CodeResult {
  const result: CodeResult = { raw: bundle, formats: Object.keys(bundle) };
  for (const [mime, value] of Object.entries(bundle)) {
    switch (mime) {
      case 'text/plain':
        result.text = value;
        break;
      case 'text/html':
        result.html = value;
        break;
      case 'text/markdown':
        result.markdown = value;
        break;
      case 'image/svg+xml':
        result.svg = value;
        break;
      case 'image/png':
        result.png = decodeBase64(value);
        break;
      case 'image/jpeg':
        result.jpeg = decodeBase64(value);
        break;
      case 'application/javascript':
        result.javascript = value;
        break;
      case 'application/json':
        try {
          result.json = typeof value === 'string' ? JSON.parse(value) : value;
        } catch {
          result.json = value;
        }
        break;
    }
  }
  return result;
}
