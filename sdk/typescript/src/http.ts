/**
 * The transport: one HTTP exchange with the API, with the key, timeouts,
 * the caller's AbortSignal, retries and the error hierarchy. Everything
 * above it speaks in paths and camelCase objects; nothing here knows a
 * resource.
 *
 * Retries: a connection error, a timeout, a 429 with `Retry-After` (a rate
 * limit; without it, a quota that waiting will not change) and a 503 are
 * retried with exponential backoff and jitter (`Retry-After` wins when
 * given), and so is a 409 with `Retry-After` to a request that carries an
 * Idempotency-Key (its first sending is still being answered), up to
 * `maxRetries` times, but only for requests that are safe to
 * send again: GET, PUT, PATCH, DELETE, and POSTs that carry an
 * Idempotency-Key (the server answers a repeat with the first answer). A
 * body that is a stream cannot be sent twice, so such a request is not
 * retried. 507 is never retried.
 */

import {
  AbortError,
  APIConnectionError,
  APIError,
  APITimeoutError,
  CladeError,
  errorClassFor,
} from './errors.js';
import { missingKeyError, type ResolvedSettings } from './settings.js';

/** What every call accepts. */
export interface RequestOptions {
  /** Aborting it ends the call; the server stops the work it started (a command, a transfer, a cell). */
  signal?: AbortSignal | undefined;
  /** This call's timeout (for a stream: until its answer starts). Default: the client's. */
  timeoutMs?: number | undefined;
  /** This call's retry budget. Default: the client's (2). */
  maxRetries?: number | undefined;
  /** Extra headers for this call. */
  headers?: Record<string, string> | undefined;
}

export type HttpMethod = 'GET' | 'POST' | 'PUT' | 'PATCH' | 'DELETE';

export type Query = Record<string, string | number | boolean | undefined | null>;

/** A body that is read once: it makes the request unretriable. */
export type StreamBody = ReadableStream<Uint8Array>;

export interface ApiRequest {
  method: HttpMethod;
  /** Under the base URL, e.g. `/v1/sandboxes`. */
  path: string;
  query?: Query | undefined;
  /** A JSON body (already in wire form). */
  json?: unknown;
  /** A raw body: bytes, a form, or a stream (sent with `duplex: 'half'`). */
  body?: Uint8Array | FormData | Blob | StreamBody | undefined;
  contentType?: string | undefined;
  accept?: string | undefined;
  /** Sends a fresh Idempotency-Key (the same on every retry of this call). */
  idempotent?: boolean | undefined;
  /** The answer is a stream: the timeout ends when it starts, and its body is the caller's to read. */
  stream?: boolean | undefined;
  /** No API key (health, version). */
  anonymous?: boolean | undefined;
  /** A credential of its own sent instead of the API key (a database broker's token). */
  bearer?: string | undefined;
}

export interface TransportConfig {
  settings: () => Promise<ResolvedSettings>;
  timeoutMs: number;
  maxRetries: number;
  fetch: typeof fetch;
  defaultHeaders: Record<string, string>;
}

const INITIAL_BACKOFF_MS = 500;
const MAX_BACKOFF_MS = 8_000;
const MAX_RETRY_AFTER_MS = 60_000;

export const SDK_VERSION = '0.1.0';

export class Transport {
  constructor(private readonly config: TransportConfig) {}

  /** The client's default timeout of a call. */
  get timeoutMs(): number {
    return this.config.timeoutMs;
  }

  /** The request's answer, parsed as JSON (undefined for a 204). */
  async json<T>(request: ApiRequest, options: RequestOptions = {}): Promise<T> {
    return this.send(request, options, async (response) => {
      if (response.status === 204) return undefined as T;
      const text = await response.text();
      return (text ? JSON.parse(text) : undefined) as T;
    });
  }

  /** The request's answer as text. */
  async text(request: ApiRequest, options: RequestOptions = {}): Promise<string> {
    return this.send(request, options, (response) => response.text());
  }

  /** The request's answer, its body unread: the caller reads (or cancels) it. */
  async stream(request: ApiRequest, options: RequestOptions = {}): Promise<Response> {
    return this.send({ ...request, stream: true }, options, async (response) => response);
  }

  /** The absolute URL of a path (for URLs handed to users). */
  async url(path: string, query?: Query): Promise<string> {
    const { baseUrl } = await this.config.settings();
    return buildUrl(baseUrl, path, query);
  }

  private async send<T>(request: ApiRequest, options: RequestOptions, read: (response: Response) => Promise<T>): Promise<T> {
    const settings = await this.config.settings();
    if (!request.anonymous && request.bearer === undefined && !settings.apiKey) throw missingKeyError();
    const url = buildUrl(settings.baseUrl, request.path, request.query);
    const headers: Record<string, string> = {
      'User-Agent': `clade-sdk-typescript/${SDK_VERSION}`,
      ...this.config.defaultHeaders,
      ...options.headers,
    };
    const bearer = request.bearer ?? (request.anonymous ? undefined : settings.apiKey);
    if (bearer) headers['Authorization'] = `Bearer ${bearer}`;
    if (request.accept) headers['Accept'] = request.accept;
    if (request.idempotent) headers['Idempotency-Key'] ??= randomUuid();
    let body: BodyInit | undefined;
    if (request.json !== undefined) {
      body = JSON.stringify(request.json);
      headers['Content-Type'] = 'application/json';
    } else if (request.body !== undefined) {
      body = request.body as BodyInit;
      if (request.contentType) headers['Content-Type'] = request.contentType;
    }
    const replayable = !(request.body instanceof ReadableStream);
    const retrySafe = replayable && (request.method !== 'POST' || 'Idempotency-Key' in headers);
    const maxRetries = options.maxRetries ?? this.config.maxRetries;
    const timeoutMs = options.timeoutMs ?? this.config.timeoutMs;

    for (let attempt = 0; ; attempt++) {
      const outcome = await this.attempt({ url, method: request.method, headers, body, stream: !!request.stream }, options.signal, timeoutMs, read);
      const retriesLeft = attempt < maxRetries;
      if (outcome.ok) return outcome.value;
      const { failure } = outcome;
      if (failure instanceof APIError) {
        const wait = retriesLeft && retrySafe ? retryDelay(failure, attempt, 'Idempotency-Key' in headers) : null;
        if (wait === null) throw failure;
        await sleep(wait, options.signal);
      } else if (failure instanceof APIConnectionError && retriesLeft && retrySafe) {
        await sleep(backoff(attempt), options.signal);
      } else {
        throw failure;
      }
    }
  }

  /** One exchange: the value, or what went wrong (thrown only for bugs). */
  private async attempt<T>(
    exchange: { url: string; method: HttpMethod; headers: Record<string, string>; body: BodyInit | undefined; stream: boolean },
    signal: AbortSignal | undefined,
    timeoutMs: number,
    read: (response: Response) => Promise<T>,
  ): Promise<{ ok: true; value: T } | { ok: false; failure: CladeError }> {
    if (signal?.aborted) return { ok: false, failure: abortError(signal) };
    const controller = new AbortController();
    let timedOut = false;
    const timer = setTimeout(() => {
      timedOut = true;
      controller.abort();
    }, timeoutMs);
    const onAbort = () => controller.abort(signal?.reason);
    signal?.addEventListener('abort', onAbort, { once: true });
    const release = () => {
      clearTimeout(timer);
      signal?.removeEventListener('abort', onAbort);
    };
    const failed = (error: unknown): { ok: false; failure: CladeError } => {
      if (signal?.aborted) return { ok: false, failure: abortError(signal) };
      if (timedOut) return { ok: false, failure: new APITimeoutError(`no answer from ${exchange.method} ${exchange.url} within ${timeoutMs} ms`) };
      if (error instanceof CladeError) return { ok: false, failure: error };
      if (error instanceof SyntaxError) return { ok: false, failure: new CladeError(`the server's answer is not JSON: ${error.message}`, { cause: error }) };
      return { ok: false, failure: new APIConnectionError(`${exchange.method} ${exchange.url} failed: ${describeCause(error)}`, { cause: error }) };
    };
    let response: Response;
    try {
      const init: RequestInit & { duplex?: 'half'; window?: null } = {
        method: exchange.method,
        headers: exchange.headers,
        body: exchange.body ?? null,
        signal: controller.signal,
      };
      if (exchange.body instanceof ReadableStream) {
        init.duplex = 'half';
        // A fetch may follow a redirect only with a copy of the body, so it
        // tees a stream body and keeps the unread branch: the whole upload,
        // in memory (Node's fetch does: nodejs/undici#4058). With no window
        // and redirects refused (the API never redirects), the fetch
        // standard sends the request itself, and nothing is kept.
        init.window = null;
        init.redirect = 'error';
      }
      response = await this.config.fetch(exchange.url, init);
    } catch (error) {
      release();
      return failed(error);
    }
    if (!response.ok) {
      try {
        const failure = await errorFromResponse(response);
        return { ok: false, failure };
      } catch (error) {
        return failed(error);
      } finally {
        release();
      }
    }
    if (exchange.stream) {
      // The caller reads the body; the timeout no longer applies, the signal still does.
      clearTimeout(timer);
      const value = await read(response);
      return { ok: true, value };
    }
    try {
      return { ok: true, value: await read(response) };
    } catch (error) {
      return failed(error);
    } finally {
      release();
    }
  }
}

/** How long to wait before retrying an error answer, or null to give up. */
function retryDelay(error: APIError, attempt: number, idempotencyKey: boolean): number | null {
  const retryAfter = parseRetryAfter(error.headers?.get('retry-after'));
  switch (error.status) {
    case 429:
      // Without Retry-After it is a quota: waiting does not change it.
      return retryAfter ?? null;
    case 503:
      return retryAfter ?? backoff(attempt);
    case 409:
      // With Retry-After on a keyed request: the first request with this
      // key is still being answered, and a repeat gets its answer. Any
      // other 409 is about the resource's state: repeating does not help.
      return idempotencyKey ? retryAfter : null;
    default:
      return null;
  }
}

function parseRetryAfter(value: string | null | undefined): number | null {
  if (!value) return null;
  const seconds = Number(value);
  if (Number.isFinite(seconds) && seconds >= 0) return Math.min(seconds * 1000, MAX_RETRY_AFTER_MS);
  const date = Date.parse(value);
  if (Number.isNaN(date)) return null;
  return Math.min(Math.max(0, date - Date.now()), MAX_RETRY_AFTER_MS);
}

/** Exponential backoff with jitter: 0.5 s, 1 s, 2 s… (each 75–100 %), at most 8 s. */
function backoff(attempt: number): number {
  const full = Math.min(INITIAL_BACKOFF_MS * 2 ** attempt, MAX_BACKOFF_MS);
  return full * (0.75 + Math.random() * 0.25);
}

/** Waits `ms`; an abort of `signal` ends the wait with its AbortError. */
export function sleep(ms: number, signal: AbortSignal | undefined): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(abortError(signal));
    const timer = setTimeout(() => {
      signal?.removeEventListener('abort', onAbort);
      resolve();
    }, ms);
    const onAbort = () => {
      clearTimeout(timer);
      reject(abortError(signal!));
    };
    signal?.addEventListener('abort', onAbort, { once: true });
  });
}

export function abortError(signal: AbortSignal): AbortError {
  const reason: unknown = signal.reason;
  if (reason instanceof AbortError) return reason;
  const why = reason instanceof Error ? reason.message : reason === undefined ? '' : String(reason);
  return new AbortError(why && why !== 'This operation was aborted' ? `aborted: ${why}` : 'the request was aborted', { cause: reason });
}

/** The error of an answer with an error status. */
export async function errorFromResponse(response: Response): Promise<APIError> {
  const text = await response.text().catch(() => '');
  let body: unknown = text;
  try {
    body = text ? JSON.parse(text) : undefined;
  } catch {
    // not JSON: keep the text
  }
  const fields = (body && typeof body === 'object' ? body : {}) as { error?: unknown; detail?: unknown; request_id?: unknown };
  const message = typeof fields.error === 'string' ? fields.error : text.trim().slice(0, 500) || response.statusText || 'error';
  const ErrorClass = errorClassFor(response.status);
  return new ErrorClass({
    status: response.status,
    error: message,
    detail: typeof fields.detail === 'string' ? fields.detail : undefined,
    requestId: typeof fields.request_id === 'string' ? fields.request_id : (response.headers.get('x-request-id') ?? undefined),
    body,
    headers: response.headers,
  });
}

function describeCause(error: unknown): string {
  if (!(error instanceof Error)) return String(error);
  const cause = (error as { cause?: unknown }).cause;
  const inner = cause instanceof Error ? `: ${cause.message}` : '';
  return `${error.message}${inner}`;
}

export function buildUrl(baseUrl: string, path: string, query?: Query): string {
  let url = `${baseUrl}${path}`;
  if (query) {
    const params = new URLSearchParams();
    for (const [key, value] of Object.entries(query)) {
      if (value !== undefined && value !== null) params.set(key, String(value));
    }
    const encoded = params.toString();
    if (encoded) url += `?${encoded}`;
  }
  return url;
}

/** A version 4 UUID, from Web Crypto where the runtime has it. */
export function randomUuid(): string {
  const c = (globalThis as { crypto?: Crypto }).crypto;
  if (c && typeof c.randomUUID === 'function') return c.randomUUID();
  const bytes = new Uint8Array(16);
  if (c && typeof c.getRandomValues === 'function') c.getRandomValues(bytes);
  else for (let i = 0; i < 16; i++) bytes[i] = Math.floor(Math.random() * 256);
  bytes[6] = (bytes[6]! & 0x0f) | 0x40;
  bytes[8] = (bytes[8]! & 0x3f) | 0x80;
  const hex = Array.from(bytes, (b) => b.toString(16).padStart(2, '0')).join('');
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20)}`;
}

/** Path segments are the caller's strings: encode them. */
export const seg = (value: string | number): string => encodeURIComponent(String(value));
