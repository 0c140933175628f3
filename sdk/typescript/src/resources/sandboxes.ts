/** `client.sandboxes`: create, list, get, delete. */

import { seg, type RequestOptions, type Transport } from '../http.js';
import type { CreateSandboxParams, SandboxInfo } from '../models.js';
import { Sandbox } from '../sandbox.js';
import { fromWire, toWire } from '../wire.js';

export class Sandboxes {
  constructor(private readonly transport: Transport) {}

  /**
   * A new sandbox, running. Sent with an Idempotency-Key, so a retry after
   * a lost answer never makes a second one.
   */
  async create(params: CreateSandboxParams = {}, options: RequestOptions = {}): Promise<Sandbox> {
    const answer = await this.transport.json({ method: 'POST', path: '/v1/sandboxes', json: toWire('CreateSandboxBody', params), idempotent: true }, options);
    return new Sandbox(this.transport, fromWire<SandboxInfo>('Sandbox', answer));
  }

  /** The workspace's sandboxes. */
  async list(options: RequestOptions = {}): Promise<Sandbox[]> {
    const answer = await this.transport.json<unknown[]>({ method: 'GET', path: '/v1/sandboxes' }, options);
    return fromWire<SandboxInfo[]>('Sandbox', answer).map((info) => new Sandbox(this.transport, info));
  }

  /** A sandbox by id (another workspace's is a NotFoundError, like a missing one). */
  async get(id: string, options: RequestOptions = {}): Promise<Sandbox> {
    const answer = await this.transport.json({ method: 'GET', path: `/v1/sandboxes/${seg(id)}` }, options);
    return new Sandbox(this.transport, fromWire<SandboxInfo>('Sandbox', answer));
  }

  async delete(id: string, options: RequestOptions = {}): Promise<void> {
    await this.transport.json({ method: 'DELETE', path: `/v1/sandboxes/${seg(id)}` }, options);
  }
}
