/** `client.keys`: the workspace's API keys. */

import { seg, type RequestOptions, type Transport } from '../http.js';
import type { ApiKey, CreateKeyParams } from '../models.js';
import { fromWire, toWire } from '../wire.js';

export class Keys {
  constructor(private readonly transport: Transport) {}

  /** The keys that are not revoked (without their secrets). */
  async list(options: RequestOptions = {}): Promise<ApiKey[]> {
    const answer = await this.transport.json<{ items: unknown[] }>({ method: 'GET', path: '/v1/me/tokens' }, options);
    return fromWire<ApiKey[]>('Token', answer.items);
  }

  /** A new key; its secret is in `token`, shown only here. `expiresInDays`: 1 to 3650 (never, by default). */
  async create(params: CreateKeyParams = {}, options: RequestOptions = {}): Promise<ApiKey & { token: string }> {
    const answer = await this.transport.json({ method: 'POST', path: '/v1/me/tokens', json: toWire('CreateToken', params) }, options);
    return fromWire<ApiKey & { token: string }>('Token', answer);
  }

  /** Revokes a key by its prefix (or id). */
  async revoke(prefix: string, options: RequestOptions = {}): Promise<void> {
    await this.transport.json({ method: 'DELETE', path: `/v1/me/tokens/${seg(prefix)}` }, options);
  }
}
