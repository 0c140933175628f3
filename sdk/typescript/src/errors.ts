/**
 * One error hierarchy for everything the SDK throws. An answer of the API
 * with an error status is an {@link APIError} subclass chosen by the
 * status; a request that got no answer is an {@link APIConnectionError}
 * (or {@link APITimeoutError}); a call the caller aborted is an
 * {@link AbortError}; a command run with `check: true` that exited non-zero
 * is a {@link CommandExitError}.
 */

import type { DatabaseInfo, FunctionInfo } from './models.js';

/** The base of every error this SDK throws. */
export class CladeError extends Error {
  override name = 'CladeError';
}

/** What the server said in an error body (`{"error", "detail"?, "request_id"}`). */
export interface ErrorFields {
  status: number;
  /** The server's `error` message. */
  error: string;
  /** The server's `detail` (why a 401 was refused), if any. */
  detail?: string | undefined;
  /** From the body's `request_id`, else the `X-Request-Id` header. */
  requestId?: string | undefined;
  /** The whole parsed body (or its text when it was not JSON). */
  body?: unknown;
  headers?: Headers | undefined;
}

/** The server answered with an error status. */
export class APIError extends CladeError {
  override name = 'APIError';
  readonly status: number;
  readonly error: string;
  readonly detail: string | undefined;
  readonly requestId: string | undefined;
  readonly body: unknown;
  readonly headers: Headers | undefined;

  constructor(fields: ErrorFields) {
    super(describe(fields));
    this.status = fields.status;
    this.error = fields.error;
    this.detail = fields.detail;
    this.requestId = fields.requestId;
    this.body = fields.body;
    this.headers = fields.headers;
  }
}

function describe({ status, error, detail, requestId }: ErrorFields): string {
  let message = `${status} ${error}`;
  if (detail) message += `: ${detail}`;
  if (requestId) message += ` (request ${requestId})`;
  return message;
}

export class BadRequestError extends APIError {
  override name = 'BadRequestError';
}
export class AuthenticationError extends APIError {
  override name = 'AuthenticationError';
}
export class PermissionDeniedError extends APIError {
  override name = 'PermissionDeniedError';
}
/** 404: no such sandbox, file, template… (another workspace's sandbox too). */
export class NotFoundError extends APIError {
  override name = 'NotFoundError';
}
/** 409: not possible in the resource's current state. */
export class ConflictError extends APIError {
  override name = 'ConflictError';
}
/** 413: a body over the server's limit. */
export class PayloadTooLargeError extends APIError {
  override name = 'PayloadTooLargeError';
}
/** 422: e.g. an Idempotency-Key reused for a different request. */
export class UnprocessableEntityError extends APIError {
  override name = 'UnprocessableEntityError';
}
/** 429: a rate limit (with Retry-After, retried) or a quota (without). */
export class RateLimitError extends APIError {
  override name = 'RateLimitError';
}
/** Any 5xx not named below. */
export class InternalServerError extends APIError {
  override name = 'InternalServerError';
}
/** 503: no capacity now, or waking the sandbox failed (retried). */
export class ServiceUnavailableError extends InternalServerError {
  override name = 'ServiceUnavailableError';
}
/** 504: a command or cell ran past its timeout and was stopped. */
export class GatewayTimeoutError extends InternalServerError {
  override name = 'GatewayTimeoutError';
}
/** 507: the host cannot hold it (not retried: waiting rarely helps). */
export class InsufficientStorageError extends InternalServerError {
  override name = 'InsufficientStorageError';
}

/** The error class for an HTTP status. */
export function errorClassFor(status: number): typeof APIError {
  switch (status) {
    case 400:
      return BadRequestError;
    case 401:
      return AuthenticationError;
    case 403:
      return PermissionDeniedError;
    case 404:
      return NotFoundError;
    case 409:
      return ConflictError;
    case 413:
      return PayloadTooLargeError;
    case 422:
      return UnprocessableEntityError;
    case 429:
      return RateLimitError;
    case 503:
      return ServiceUnavailableError;
    case 504:
      return GatewayTimeoutError;
    case 507:
      return InsufficientStorageError;
    default:
      return status >= 500 ? InternalServerError : APIError;
  }
}

/** No answer: the connection failed or broke. */
export class APIConnectionError extends CladeError {
  override name = 'APIConnectionError';
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
  }
}

/** No answer within the call's `timeoutMs`. */
export class APITimeoutError extends APIConnectionError {
  override name = 'APITimeoutError';
}

/** The caller's AbortSignal fired; the server stops what the call started. */
export class AbortError extends CladeError {
  override name = 'AbortError';
  constructor(message = 'the request was aborted', options?: { cause?: unknown }) {
    super(message, options);
  }
}

/** A command run with `check: true` exited with a non-zero code. */
export class CommandExitError extends CladeError {
  override name = 'CommandExitError';
  readonly exitCode: number;
  readonly stdout: string;
  readonly stderr: string;
  readonly command: string;

  constructor(command: string, result: { exitCode: number; stdout: string; stderr: string }) {
    const tail = result.stderr.trim().split('\n').slice(-5).join('\n');
    super(`command exited with code ${result.exitCode}: ${command}${tail ? `\n${tail}` : ''}`);
    this.command = command;
    this.exitCode = result.exitCode;
    this.stdout = result.stdout;
    this.stderr = result.stderr;
  }
}

/** A stream (events, logs, a cell) ended with an error event from the server. */
export class StreamError extends CladeError {
  override name = 'StreamError';
}

/** A database being waited for ended `failed`; `database.error` says why. */
export class DatabaseFailedError extends CladeError {
  override name = 'DatabaseFailedError';
  readonly database: DatabaseInfo;

  constructor(database: DatabaseInfo) {
    super(`database ${database.id} failed: ${database.error || 'no reason given'}`);
    this.database = database;
  }
}

/**
 * A database was not ready by the wait's deadline. It is not deleted:
 * `database` is what the server last said of it, and waiting again may
 * still see it ready.
 */
export class DatabaseTimeoutError extends CladeError {
  override name = 'DatabaseTimeoutError';
  readonly database: DatabaseInfo;

  constructor(database: DatabaseInfo, deadlineMs: number) {
    super(`database ${database.id} is still ${database.status} after ${deadlineMs} ms`);
    this.database = database;
  }
}

/**
 * A function's deploy being waited for ended `failed`: `function.error`
 * says why and `deployLog` is the end of its install's output. The version
 * before it, if any, still runs.
 */
export class FunctionDeployError extends CladeError {
  override name = 'FunctionDeployError';
  readonly function: FunctionInfo;
  /** The end of the install's output (`function.deployLog`). */
  readonly deployLog: string;

  constructor(fn: FunctionInfo) {
    super(`deploying function ${fn.id} (version ${fn.version}) failed: ${fn.error || 'no reason given'}`);
    this.function = fn;
    this.deployLog = fn.deployLog ?? '';
  }
}

/**
 * A function's deploy had not ended by the wait's deadline. Nothing is
 * stopped: `function` is what the server last said of it, and waiting
 * again may still see it ready.
 */
export class FunctionDeployTimeoutError extends CladeError {
  override name = 'FunctionDeployTimeoutError';
  readonly function: FunctionInfo;

  constructor(fn: FunctionInfo, deadlineMs: number) {
    super(`function ${fn.id} is still ${fn.status} after ${deadlineMs} ms`);
    this.function = fn;
  }
}
