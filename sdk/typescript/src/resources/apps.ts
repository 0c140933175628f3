/**
 * `client.apps`: services deployed from git. An app answers at its host
 * name, `{name}.{suffix}` (its `url` once live); each deployment fetches a
 * branch, tag or commit, builds it in a sandbox of its own and goes live
 * when its port answers HTTP, replacing the live one in one switch. The
 * deployments before it keep their sandbox, hibernated, for a rollback.
 */

import { seg, type RequestOptions, type Transport } from '../http.js';
import type { AppEnvImported, AppEnvSet, AppEnvVar, AppInfo, CreateAppParams, DeploymentInfo, UpdateAppParams } from '../models.js';
import { streamOf } from '../sandbox.js';
import { fromWire, toWire } from '../wire.js';

export interface AppDeployOptions extends RequestOptions {
  /** A branch, tag or commit to deploy; default the app's branch. */
  gitRef?: string | undefined;
}

export interface AppEnvOptions extends RequestOptions {
  /** Masked in every answer (`••••••••`); the app's process gets the value. */
  secret?: boolean | undefined;
  /** `all` (the default) or `production` reach deployments; `preview` none (there are no previews). */
  scope?: string | undefined;
}

const path = (id: string, rest = '') => `/v1/apps/${seg(id)}${rest}`;

export class Apps {
  constructor(private readonly transport: Transport) {}

  /**
   * A new app, `created`: nothing runs until a {@link deploy}. Its `name`
   * is its host name's first label (1 to 40 lowercase letters, digits and
   * `-`), unique on the server: a taken one is a ConflictError, a bad or
   * reserved one a BadRequestError. `env` holds plain variables (secrets:
   * {@link setEnv}).
   */
  async create(params: CreateAppParams, options: RequestOptions = {}): Promise<AppInfo> {
    const json = toWire('AppBody', params);
    return fromWire<AppInfo>('AppInfo', await this.transport.json({ method: 'POST', path: '/v1/apps', json }, options));
  }

  /** The workspace's apps, oldest first. */
  async list(options: RequestOptions = {}): Promise<AppInfo[]> {
    const answer = await this.transport.json<{ items: unknown[] }>({ method: 'GET', path: '/v1/apps' }, options);
    return fromWire<AppInfo[]>('AppInfo', answer.items);
  }

  /** An app, by id or name (another workspace's is a NotFoundError); secrets in its `env` are masked. */
  async get(id: string, options: RequestOptions = {}): Promise<AppInfo> {
    return fromWire<AppInfo>('AppInfo', await this.transport.json({ method: 'GET', path: path(id) }, options));
  }

  /** Changes its settings (each one given replaces the app's); they apply from its next deployment. */
  async update(id: string, params: UpdateAppParams, options: RequestOptions = {}): Promise<AppInfo> {
    const json = toWire('AppBody', params);
    return fromWire<AppInfo>('AppInfo', await this.transport.json({ method: 'PATCH', path: path(id), json }, options));
  }

  /** Deletes it: its host name stops answering and its deployments' sandboxes are removed. */
  async delete(id: string, options: RequestOptions = {}): Promise<void> {
    await this.transport.json({ method: 'DELETE', path: path(id) }, options);
  }

  /**
   * Starts a deployment of the app's branch (or `options.gitRef`) and
   * resolves with it `queued`, at once: follow it with {@link deployLogs},
   * which ends when it does, then {@link deployment}: `live`, or `failed`
   * with its `error` (the live deployment keeps serving). Not retried: a
   * repeat would deploy twice.
   */
  async deploy(id: string, options: AppDeployOptions = {}): Promise<DeploymentInfo> {
    const json = toWire('DeployBody', { gitRef: options.gitRef });
    return fromWire<DeploymentInfo>('DeploymentInfo', await this.transport.json({ method: 'POST', path: path(id, '/deploys'), json }, options));
  }

  /** Its deployments, newest first, without their logs. */
  async deployments(id: string, options: RequestOptions = {}): Promise<DeploymentInfo[]> {
    const answer = await this.transport.json<{ items: unknown[] }>({ method: 'GET', path: path(id, '/deploys') }, options);
    return fromWire<DeploymentInfo[]>('DeploymentInfo', answer.items);
  }

  /** A deployment, with its log so far (`buildLogs`). */
  async deployment(id: string, deploymentId: string, options: RequestOptions = {}): Promise<DeploymentInfo> {
    const answer = await this.transport.json({ method: 'GET', path: path(id, `/deploys/${seg(deploymentId)}`) }, options);
    return fromWire<DeploymentInfo>('DeploymentInfo', answer);
  }

  /**
   * A deployment's log lines (fetch, install, build, start), from its
   * first as they are written; the iteration ends when the deployment
   * does (live or failed). Leaving the loop early closes the connection.
   */
  deployLogs(id: string, deploymentId: string, options: RequestOptions = {}): AsyncIterable<string> {
    const request = { method: 'GET' as const, path: path(id, `/deploys/${seg(deploymentId)}/logs`), accept: 'text/event-stream' };
    const events = streamOf(this.transport, request, options, (event) => event);
    return {
      async *[Symbol.asyncIterator]() {
        for await (const event of events) {
          if (event.event === 'done') return;
          if (event.event === 'message') yield event.data;
        }
      },
    };
  }

  /**
   * Switches the app back to the newest earlier deployment that kept its
   * sandbox (the live one becomes `rolled_back`) and resolves with it,
   * `live`; its sandbox wakes with its process as it was. No live
   * deployment, or none earlier kept, is a ConflictError.
   */
  async rollback(id: string, options: RequestOptions = {}): Promise<DeploymentInfo> {
    return fromWire<DeploymentInfo>('DeploymentInfo', await this.transport.json({ method: 'POST', path: path(id, '/rollback') }, options));
  }

  /** Its variables, by name; a secret's value is masked. */
  async env(id: string, options: RequestOptions = {}): Promise<AppEnvVar[]> {
    const answer = await this.transport.json<{ env: unknown[] }>({ method: 'GET', path: path(id, '/env') }, options);
    return fromWire<AppEnvVar[]>('AppEnvVar', answer.env);
  }

  /** Sets one variable (a `secret` is masked in every answer); its next deployment gets it. */
  async setEnv(id: string, key: string, value: string, options: AppEnvOptions = {}): Promise<AppEnvSet> {
    const json = toWire('SetEnvBody', { value, secret: options.secret, scope: options.scope });
    return fromWire<AppEnvSet>('AppEnvSet', await this.transport.json({ method: 'PUT', path: path(id, `/env/${seg(key)}`), json }, options));
  }

  /** Removes one variable (an absent one is a NotFoundError); from the next deployment. */
  async unsetEnv(id: string, key: string, options: RequestOptions = {}): Promise<void> {
    await this.transport.json({ method: 'DELETE', path: path(id, `/env/${seg(key)}`) }, options);
  }

  /**
   * Sets every variable of a `.env` text (`KEY=value` lines; `#` comments,
   * blank lines, `export` and quotes as in shells): how many it set and
   * how many the app has now.
   */
  async importEnv(id: string, dotenv: string, options: AppEnvOptions = {}): Promise<AppEnvImported> {
    const json = toWire('ImportEnvBody', { dotenv, secret: options.secret, scope: options.scope });
    return fromWire<AppEnvImported>('AppEnvImported', await this.transport.json({ method: 'POST', path: path(id, '/env/import'), json }, options));
  }

  /**
   * The end of what the live deployment's process printed: at most
   * `limit` bytes (1 to 1 MiB, 64 KiB by default). No live deployment is
   * a ConflictError.
   */
  async runtimeLogs(id: string, options: RequestOptions & { limit?: number | undefined } = {}): Promise<string> {
    return this.transport.text({ method: 'GET', path: path(id, '/runtime-logs'), query: { limit: options.limit }, accept: 'text/plain' }, options);
  }
}
