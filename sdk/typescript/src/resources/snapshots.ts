/** `client.snapshots`: the workspace's snapshots (made with `sandbox.snapshot()`). */

import { seg, type RequestOptions, type Transport } from '../http.js';
import type { Snapshot } from '../models.js';
import { fromWire } from '../wire.js';

export class Snapshots {
  constructor(private readonly transport: Transport) {}

  /** The workspace's snapshots, or those of one sandbox, or the one with a name. */
  async list(options: RequestOptions & { sandboxId?: string; name?: string } = {}): Promise<Snapshot[]> {
    const answer = await this.transport.json<{ snapshots: unknown[] }>(
      { method: 'GET', path: '/v1/snapshots', query: { sandbox_id: options.sandboxId, name: options.name } },
      options,
    );
    return fromWire<Snapshot[]>('Snapshot', answer.snapshots);
  }

  async get(id: string, options: RequestOptions = {}): Promise<Snapshot> {
    return fromWire<Snapshot>('Snapshot', await this.transport.json({ method: 'GET', path: `/v1/snapshots/${seg(id)}` }, options));
  }

  /** Deletes it (sandboxes made from it keep running). */
  async delete(id: string, options: RequestOptions = {}): Promise<void> {
    await this.transport.json({ method: 'DELETE', path: `/v1/snapshots/${seg(id)}` }, options);
  }
}
