/**
 * `client.functions`: code the server keeps and runs on demand. A deploy
 * installs a function's dependencies once in a sandbox of its template and
 * snapshots it; each invoke restores that snapshot, runs the entrypoint's
 * `handler(event)` with the input, records the run and deletes the sandbox.
 */

import { encodeBase64 } from '../bytes.js';
import { CladeError, FunctionDeployError, FunctionDeployTimeoutError, NotFoundError } from '../errors.js';
import { seg, sleep, type RequestOptions, type Transport } from '../http.js';
import type {
  CreateFunctionParams,
  FunctionInfo,
  FunctionMetrics,
  FunctionRun,
  RecordRunParams,
  UpdateFunctionParams,
} from '../models.js';
import { fromWire, toWire } from '../wire.js';

/** How long a wait for a deploy lasts by default: as long as the server lets an invoke wait for one. */
export const FUNCTION_DEPLOY_DEADLINE_MS = 20 * 60_000;
/** Polling a deploy: the first look soon, then less often. */
const POLL_FIRST_MS = 250;
const POLL_MAX_MS = 2_000;

export interface FunctionWaitOptions extends RequestOptions {
  /** How long to wait for the deploy to end (default 20 minutes); then a FunctionDeployTimeoutError. */
  deadlineMs?: number | undefined;
}

export interface FunctionCreateOptions extends FunctionWaitOptions {
  /**
   * With code, wait until it is deployed (the default): the function
   * `ready`, or a FunctionDeployError. With `false`, it is returned as the
   * server recorded it (`deploying`; an invoke waits for the deploy).
   * Aborting the signal while waiting deletes the function being made.
   */
  wait?: boolean | undefined;
}

export interface FunctionDeployOptions extends FunctionWaitOptions {
  /** Another entrypoint, a file of the bundle. */
  entrypoint?: string | undefined;
  /**
   * Wait until the new code is deployed (the default); with `false`, the
   * function is returned `deploying`. Aborting the signal ends the wait,
   * not the deploy.
   */
  wait?: boolean | undefined;
}

const path = (id: string, rest = '') => `/v1/functions/${seg(id)}${rest}`;

export class Functions {
  constructor(private readonly transport: Transport) {}

  /**
   * A new function. With `code` (the entrypoint's text or bytes, sent as
   * base64) it is deployed, and by default waited for (see
   * `options.wait`): a FunctionDeployError if the deploy fails, a
   * FunctionDeployTimeoutError past `options.deadlineMs`.
   */
  async create(params: CreateFunctionParams, options: FunctionCreateOptions = {}): Promise<FunctionInfo> {
    const { code, ...rest } = params;
    const json = toWire('CreateFunctionBody', { ...rest, code: code === undefined ? undefined : encodeBase64(code) });
    const info = fromWire<FunctionInfo>('FunctionInfo', await this.transport.json({ method: 'POST', path: '/v1/functions', json }, options));
    if (options.wait === false || info.status === 'empty') return info;
    try {
      return await this.wait(info.id, options);
    } catch (error) {
      if (options.signal?.aborted) {
        // The caller never got its id: a function left behind would be nobody's, and hold its name.
        // Not under the aborted signal: the delete must still go out.
        await this.delete(info.id, { ...options, signal: undefined }).catch((e: unknown) => {
          if (!(e instanceof NotFoundError)) throw e;
        });
      }
      throw error;
    }
  }

  /**
   * New code for the function: `bundle` is a tar.gz (at most 16 MiB) that
   * holds its entrypoint, sent as the multipart field `bundle`. Waits for
   * the deploy as {@link create} does; a failed deploy leaves the version
   * before it running.
   */
  async deploy(id: string, bundle: Uint8Array | ArrayBuffer | Blob, options: FunctionDeployOptions = {}): Promise<FunctionInfo> {
    const form = new FormData();
    form.append('bundle', bundle instanceof Blob ? bundle : new Blob([bundle as BlobPart], { type: 'application/gzip' }), 'code.tar.gz');
    if (options.entrypoint !== undefined) form.append('entrypoint', options.entrypoint);
    const info = fromWire<FunctionInfo>('FunctionInfo', await this.transport.json({ method: 'POST', path: path(id, '/deploy'), body: form }, options));
    return options.wait === false ? info : this.wait(info.id, options);
  }

  /**
   * The function once its deploy ends: `ready`, else a FunctionDeployError
   * (`failed`) or a FunctionDeployTimeoutError past `deadlineMs`. Polls
   * with a growing interval; aborting the signal ends the wait (the deploy
   * goes on). A function without code has no deploy to wait for: a
   * CladeError.
   */
  async wait(id: string, options: FunctionWaitOptions = {}): Promise<FunctionInfo> {
    const deadlineMs = options.deadlineMs ?? FUNCTION_DEPLOY_DEADLINE_MS;
    const deadline = Date.now() + deadlineMs;
    for (let interval = POLL_FIRST_MS; ; interval = Math.min(interval * 1.5, POLL_MAX_MS)) {
      const info = await this.get(id, options);
      if (info.status === 'ready') return info;
      if (info.status === 'failed') throw new FunctionDeployError(info);
      if (info.status === 'empty') throw new CladeError(`function ${info.id} has no code: deploy code first`);
      const left = deadline - Date.now();
      if (left <= 0) throw new FunctionDeployTimeoutError(info, deadlineMs);
      await sleep(Math.min(interval, left), options.signal);
    }
  }

  /**
   * Runs the function once with `input` (its handler's `event`, and JSON
   * on its stdin) and resolves with the finished run: `status` says
   * whether the code succeeded, `output` is what the handler returned. A
   * deploy in progress is waited for; a function without code (or whose
   * only deploy failed) is a ServiceUnavailableError. Not retried: the
   * code may have effects. A long function needs a `timeoutMs` beyond the
   * client's.
   */
  async invoke(id: string, input?: unknown, options: RequestOptions = {}): Promise<FunctionRun> {
    const json = toWire('InvokeBody', { input });
    return fromWire<FunctionRun>('FunctionRun', await this.transport.json({ method: 'POST', path: path(id, '/invoke'), json }, options));
  }

  /** Its runs, newest first (`limit` 1 to 1000, 100 by default; the newest 1000 are kept). */
  async runs(id: string, options: RequestOptions & { limit?: number | undefined } = {}): Promise<FunctionRun[]> {
    const answer = await this.transport.json<{ items: unknown[] }>({ method: 'GET', path: path(id, '/runs'), query: { limit: options.limit } }, options);
    return fromWire<FunctionRun[]>('FunctionRun', answer.items);
  }

  /** Records a run made elsewhere among its runs (nothing is executed). */
  async recordRun(id: string, params: RecordRunParams, options: RequestOptions = {}): Promise<FunctionRun> {
    const json = toWire('RecordRunBody', params);
    return fromWire<FunctionRun>('FunctionRun', await this.transport.json({ method: 'POST', path: path(id, '/runs'), json }, options));
  }

  /** Latency percentiles, error rate and cold-start rate of its finished runs of the last `periodHours` (1 to 720, 24 by default). */
  async metrics(id: string, options: RequestOptions & { periodHours?: number | undefined } = {}): Promise<FunctionMetrics> {
    const answer = await this.transport.json({ method: 'GET', path: path(id, '/metrics'), query: { period: options.periodHours } }, options);
    return fromWire<FunctionMetrics>('Metrics', answer);
  }

  /**
   * Its code as the tar.gz the server keeps (a create's one file is in it
   * at its entrypoint); a function without code is a ServiceUnavailableError.
   */
  async code(id: string, options: RequestOptions = {}): Promise<Uint8Array> {
    const response = await this.transport.stream({ method: 'GET', path: path(id, '/code'), accept: 'application/gzip' }, options);
    return new Uint8Array(await response.arrayBuffer());
  }

  /** A function, by id or name (another workspace's is a NotFoundError). */
  async get(id: string, options: RequestOptions = {}): Promise<FunctionInfo> {
    return fromWire<FunctionInfo>('FunctionInfo', await this.transport.json({ method: 'GET', path: path(id) }, options));
  }

  /** The workspace's functions, oldest first. */
  async list(options: RequestOptions = {}): Promise<FunctionInfo[]> {
    const answer = await this.transport.json<{ items: unknown[] }>({ method: 'GET', path: '/v1/functions' }, options);
    return fromWire<FunctionInfo[]>('FunctionInfo', answer.items);
  }

  /**
   * Changes its settings: `env` (replaced whole), `public` and
   * `timeoutSeconds` apply to the next run; a new `entrypoint` or
   * `template` deploys it again (it is returned `deploying`: `wait` for it).
   */
  async update(id: string, params: UpdateFunctionParams, options: RequestOptions = {}): Promise<FunctionInfo> {
    const json = toWire('PatchFunctionBody', params);
    return fromWire<FunctionInfo>('FunctionInfo', await this.transport.json({ method: 'PATCH', path: path(id), json }, options));
  }

  /** Deletes it with its runs, its schedules and its snapshot. */
  async delete(id: string, options: RequestOptions = {}): Promise<void> {
    await this.transport.json({ method: 'DELETE', path: path(id) }, options);
  }
}
