/** `client.volumes`: named disks that outlive sandboxes (attach them with `volumes` at create). */

import { seg, type RequestOptions, type Transport } from '../http.js';
import type { CreateVolumeParams, Volume } from '../models.js';
import { fromWire, toWire } from '../wire.js';

export class Volumes {
  constructor(private readonly transport: Transport) {}

  /** An empty ext4 volume (`sizeMb` 16 to 65536; 256 by default). */
  async create(params: CreateVolumeParams, options: RequestOptions = {}): Promise<Volume> {
    const json = toWire('CreateVolumeBody', params);
    return fromWire<Volume>('Volume', await this.transport.json({ method: 'POST', path: '/v1/volumes', json }, options));
  }

  async list(options: RequestOptions = {}): Promise<Volume[]> {
    return fromWire<Volume[]>('Volume', await this.transport.json({ method: 'GET', path: '/v1/volumes' }, options));
  }

  async get(name: string, options: RequestOptions = {}): Promise<Volume> {
    return fromWire<Volume>('Volume', await this.transport.json({ method: 'GET', path: `/v1/volumes/${seg(name)}` }, options));
  }

  /** Grows it (never shrinks), its filesystem with it. */
  async resize(name: string, sizeMb: number, options: RequestOptions = {}): Promise<Volume> {
    const answer = await this.transport.json({ method: 'PATCH', path: `/v1/volumes/${seg(name)}`, json: { size_mb: sizeMb } }, options);
    return fromWire<Volume>('Volume', answer);
  }

  /** Deletes it with its data (a ConflictError while sandboxes have it). */
  async delete(name: string, options: RequestOptions = {}): Promise<void> {
    await this.transport.json({ method: 'DELETE', path: `/v1/volumes/${seg(name)}` }, options);
  }
}
