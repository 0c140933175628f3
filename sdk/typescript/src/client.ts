/** The client: settings, the transport, and the resources hung off it. */

import { Transport, type RequestOptions } from './http.js';
import type { Health, Me, Version } from './models.js';
import { Apps } from './resources/apps.js';
import { Databases } from './resources/databases.js';
import { Functions } from './resources/functions.js';
import { Keys } from './resources/keys.js';
import { Sandboxes } from './resources/sandboxes.js';
import { Schedules } from './resources/schedules.js';
import { Snapshots } from './resources/snapshots.js';
import { Templates } from './resources/templates.js';
import { Volumes } from './resources/volumes.js';
import { resolveSettings, type ResolvedSettings } from './settings.js';
import { fromWire } from './wire.js';

export interface ClientOptions {
  /** An API key (`clade_…`). Default: `CLADE_API_KEY`, then the config file. */
  apiKey?: string;
  /** The server, with or without `/v1`. Default: `CLADE_API_URL`, the config file, then http://127.0.0.1:8080. */
  baseUrl?: string;
  /** A call's timeout (a stream's: until it starts). Default 10 minutes. */
  timeoutMs?: number;
  /** Retries of a failed call that is safe to repeat. Default 2. */
  maxRetries?: number;
  /** A fetch of your own (a proxy, tracing). Default: the runtime's. */
  fetch?: typeof fetch;
  /** Headers sent with every call. */
  defaultHeaders?: Record<string, string>;
}

export const DEFAULT_TIMEOUT_MS = 10 * 60_000;
export const DEFAULT_MAX_RETRIES = 2;

export class Clade {
  readonly sandboxes: Sandboxes;
  readonly snapshots: Snapshots;
  readonly templates: Templates;
  readonly volumes: Volumes;
  readonly keys: Keys;
  readonly databases: Databases;
  readonly functions: Functions;
  readonly schedules: Schedules;
  readonly apps: Apps;
  private readonly transport: Transport;
  private settings: Promise<ResolvedSettings> | undefined;

  constructor(private readonly options: ClientOptions = {}) {
    const runtimeFetch = options.fetch ?? globalThis.fetch;
    if (typeof runtimeFetch !== 'function') throw new TypeError('no fetch: use Node 18+, Bun or Deno, or pass { fetch }');
    this.transport = new Transport({
      settings: () => (this.settings ??= resolveSettings(options)),
      timeoutMs: options.timeoutMs ?? DEFAULT_TIMEOUT_MS,
      maxRetries: options.maxRetries ?? DEFAULT_MAX_RETRIES,
      fetch: runtimeFetch.bind(globalThis),
      defaultHeaders: options.defaultHeaders ?? {},
    });
    this.sandboxes = new Sandboxes(this.transport);
    this.snapshots = new Snapshots(this.transport);
    this.templates = new Templates(this.transport);
    this.volumes = new Volumes(this.transport);
    this.keys = new Keys(this.transport);
    this.databases = new Databases(this.transport);
    this.functions = new Functions(this.transport);
    this.schedules = new Schedules(this.transport);
    this.apps = new Apps(this.transport);
  }

  /** The server and key this client uses (after options, environment and config file). */
  async resolvedSettings(): Promise<ResolvedSettings> {
    return (this.settings ??= resolveSettings(this.options));
  }

  /** The caller: its key and workspace. */
  async me(options: RequestOptions = {}): Promise<Me> {
    return fromWire<Me>('Me', await this.transport.json({ method: 'GET', path: '/v1/me' }, options));
  }

  /** Whether the server answers (no key needed). */
  async health(options: RequestOptions = {}): Promise<Health> {
    return fromWire<Health>('Health', await this.transport.json({ method: 'GET', path: '/healthz', anonymous: true }, options));
  }

  /** The server's version (no key needed). */
  async version(options: RequestOptions = {}): Promise<Version> {
    return fromWire<Version>('Version', await this.transport.json({ method: 'GET', path: '/version', anonymous: true }, options));
  }
}
