/**
 * `client.databases`: managed PostgreSQL 15. Each database runs in a
 * sandbox of the workspace; clients connect with its `connectionUrl` (TLS,
 * through the server's PostgreSQL endpoint), or run statements over HTTP
 * with `query`.
 */

import { DatabaseFailedError, DatabaseTimeoutError, NotFoundError } from '../errors.js';
import { seg, sleep, type RequestOptions, type Transport } from '../http.js';
import type {
  CloneDatabaseParams,
  ConnectionInfo,
  CreateDatabaseParams,
  DatabaseInfo,
  DatabaseStats,
  QueryResult,
  UpdateDatabaseParams,
} from '../models.js';
import { fromWire, toWire } from '../wire.js';

/** How long a wait for a database lasts by default: the first of a size bakes its template (tens of seconds under TCG). */
export const DATABASE_DEADLINE_MS = 5 * 60_000;
/** Polling a database being made: the first look soon, then less often. */
const POLL_FIRST_MS = 250;
const POLL_MAX_MS = 2_000;

export interface DatabaseWaitOptions extends RequestOptions {
  /** How long to wait for it to be ready (default 5 minutes); then a DatabaseTimeoutError. */
  deadlineMs?: number | undefined;
}

export interface DatabaseCreateOptions extends DatabaseWaitOptions {
  /**
   * Wait until it is running, with its credentials (the default); with
   * `false`, it is returned as the server recorded it (`provisioning`).
   * Aborting the signal while waiting deletes the database being made.
   */
  wait?: boolean | undefined;
}

export interface QueryOptions extends RequestOptions {
  /** The database's broker token; by default the SDK asks `connection()` for it (one request more). */
  brokerToken?: string | undefined;
}

const path = (id: string, rest = '') => `/v1/databases/${seg(id)}${rest}`;

export class Databases {
  constructor(private readonly transport: Transport) {}

  /**
   * A new database, running with its credentials (see `options.wait`); a
   * DatabaseFailedError if it fails, a DatabaseTimeoutError past
   * `options.deadlineMs`.
   */
  async create(params: CreateDatabaseParams = {}, options: DatabaseCreateOptions = {}): Promise<DatabaseInfo> {
    const json = toWire('CreateDatabaseBody', params);
    const info = fromWire<DatabaseInfo>('DatabaseInfo', await this.transport.json({ method: 'POST', path: '/v1/databases', json }, options));
    return this.waitForNew(info, options);
  }

  /**
   * The database once it is ready (running, or hibernated: a connection
   * wakes it), with its credentials. Polls with a growing interval; a
   * DatabaseFailedError if it fails, a DatabaseTimeoutError past
   * `deadlineMs`; aborting the signal ends the wait (the database stays).
   */
  async wait(id: string, options: DatabaseWaitOptions = {}): Promise<DatabaseInfo> {
    const deadlineMs = options.deadlineMs ?? DATABASE_DEADLINE_MS;
    const deadline = Date.now() + deadlineMs;
    for (let interval = POLL_FIRST_MS; ; interval = Math.min(interval * 1.5, POLL_MAX_MS)) {
      const info = await this.get(id, options);
      if ((info.status === 'running' || info.status === 'hibernated') && info.connectionUrl) return info;
      if (info.status === 'failed') throw new DatabaseFailedError(info);
      const left = deadline - Date.now();
      if (left <= 0) throw new DatabaseTimeoutError(info, deadlineMs);
      await sleep(Math.min(interval, left), options.signal);
    }
  }

  private async waitForNew(info: DatabaseInfo, options: DatabaseCreateOptions): Promise<DatabaseInfo> {
    if (options.wait === false) return info;
    try {
      return await this.wait(info.id, options);
    } catch (error) {
      if (options.signal?.aborted) {
        // The caller never got its id: a database left behind would be nobody's.
        // Not under the aborted signal: the delete must still go out.
        await this.delete(info.id, { ...options, signal: undefined }).catch((e: unknown) => {
          if (!(e instanceof NotFoundError)) throw e;
        });
      }
      throw error;
    }
  }

  /** The workspace's databases, oldest first, without credentials. */
  async list(options: RequestOptions = {}): Promise<DatabaseInfo[]> {
    const answer = await this.transport.json<{ items: unknown[] }>({ method: 'GET', path: '/v1/databases' }, options);
    return fromWire<DatabaseInfo[]>('DatabaseInfo', answer.items);
  }

  /** A database, with its credentials once it is ready (another workspace's is a NotFoundError). */
  async get(id: string, options: RequestOptions = {}): Promise<DatabaseInfo> {
    return fromWire<DatabaseInfo>('DatabaseInfo', await this.transport.json({ method: 'GET', path: path(id) }, options));
  }

  /** `alwaysOn: true`: never idled into hibernation. */
  async update(id: string, params: UpdateDatabaseParams, options: RequestOptions = {}): Promise<DatabaseInfo> {
    const json = toWire('PatchDatabaseBody', params);
    return fromWire<DatabaseInfo>('DatabaseInfo', await this.transport.json({ method: 'PATCH', path: path(id), json }, options));
  }

  /** Deletes it with its data and its sandbox. */
  async delete(id: string, options: RequestOptions = {}): Promise<void> {
    await this.transport.json({ method: 'DELETE', path: path(id) }, options);
  }

  /** Its `connectionUrl`, `brokerUrl` and `brokerToken` (a ServiceUnavailableError until it is ready). */
  async connection(id: string, options: RequestOptions = {}): Promise<ConnectionInfo> {
    return fromWire<ConnectionInfo>('ConnectionInfo', await this.transport.json({ method: 'GET', path: path(id, '/connection') }, options));
  }

  /** A new password and broker token; the old ones open nothing, and the sessions opened with them are ended. */
  async resetCredentials(id: string, options: RequestOptions = {}): Promise<DatabaseInfo> {
    const answer = await this.transport.json({ method: 'POST', path: path(id, '/reset-credentials') }, options);
    return fromWire<DatabaseInfo>('DatabaseInfo', answer);
  }

  /** Restores a hibernated database (a connection would too); its status. */
  async wake(id: string, options: RequestOptions = {}): Promise<string> {
    return (await this.transport.json<{ status: string }>({ method: 'POST', path: path(id, '/wake') }, options)).status;
  }

  /**
   * A new database with credentials of its own and the source's data as it
   * is now (a copy-on-write fork of its VM), or with `targetTime` (RFC 3339)
   * as it was then (point-in-time recovery from its archived WAL). Waits as
   * {@link create} does.
   */
  async clone(id: string, params: CloneDatabaseParams = {}, options: DatabaseCreateOptions = {}): Promise<DatabaseInfo> {
    const json = toWire('CloneBody', params);
    const info = fromWire<DatabaseInfo>('DatabaseInfo', await this.transport.json({ method: 'POST', path: path(id, '/clone'), json }, options));
    return this.waitForNew(info, options);
  }

  /**
   * Rebuilds the database in a new sandbox from its newest base backup and
   * the WAL shipped after it: the same id, address and password (`sandboxId`
   * is the new one). Resolves when done. A `ConflictError` until its first
   * base backup is taken (seconds after it is made; `failoverAvailable`
   * says when).
   */
  async failover(id: string, options: RequestOptions = {}): Promise<DatabaseInfo> {
    return fromWire<DatabaseInfo>('DatabaseInfo', await this.transport.json({ method: 'POST', path: path(id, '/failover') }, options));
  }

  async stats(id: string, options: RequestOptions = {}): Promise<DatabaseStats> {
    const answer = await this.transport.json<Record<string, unknown>>({ method: 'GET', path: path(id, '/stats') }, options);
    return {
      postgresVersion: String(answer['postgres_version']),
      dbSizeBytes: Number(answer['db_size_bytes']),
      connections: Number(answer['connections']),
      maxConnections: Number(answer['max_connections']),
    };
  }

  /** The end of its server's log (at most 256 KiB). */
  async logs(id: string, options: RequestOptions = {}): Promise<string> {
    return (await this.transport.json<{ logs: string }>({ method: 'GET', path: path(id, '/logs') }, options)).logs;
  }

  /**
   * Runs one statement through the database's HTTP broker, `$1`, `$2`…
   * taken from `params` (PostgreSQL reads each as the type it infers for
   * its placeholder). The broker is opened by the database's broker token,
   * not the API key: `options.brokerToken`, else the one `connection()`
   * answers. A SQL error is a BadRequestError with its SQLSTATE; a token
   * that is not the database's, an AuthenticationError. Not retried: the
   * statement may write.
   */
  async query(id: string, sql: string, params?: readonly unknown[], options: QueryOptions = {}): Promise<QueryResult> {
    const bearer = options.brokerToken ?? (await this.connection(id, options)).brokerToken;
    const json = toWire('QueryRequest', { sql, params });
    return fromWire<QueryResult>('QueryResult', await this.transport.json({ method: 'POST', path: path(id, '/proxy'), json, bearer }, options));
  }
}
