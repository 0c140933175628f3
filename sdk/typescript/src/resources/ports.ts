/** A sandbox's ports, their preview URLs and preview tokens. */

import { seg, type RequestOptions, type Transport } from '../http.js';
import type { PortInfo, PreviewToken } from '../models.js';
import { fromWire } from '../wire.js';

export class Ports {
  constructor(
    private readonly transport: Transport,
    private readonly sandboxId: string,
  ) {}

  private get path(): string {
    return `/v1/sandboxes/${seg(this.sandboxId)}`;
  }

  /** Ports something listens on (but 22) and labelled ones, by port. */
  async list(options: RequestOptions = {}): Promise<PortInfo[]> {
    return fromWire<PortInfo[]>('PortInfo', await this.transport.json({ method: 'GET', path: `${this.path}/ports` }, options));
  }

  /** Labels a port so that it is listed (adding it again changes its label). */
  async add(port: number, options: RequestOptions & { label?: string } = {}): Promise<PortInfo> {
    const answer = await this.transport.json(
      { method: 'POST', path: `${this.path}/ports`, json: { port, ...(options.label !== undefined ? { label: options.label } : {}) } },
      options,
    );
    return fromWire<PortInfo>('PortInfo', answer);
  }

  /** Removes a port's label (the port still works if something listens on it). */
  async remove(port: number, options: RequestOptions = {}): Promise<void> {
    await this.transport.json({ method: 'DELETE', path: `${this.path}/ports/${seg(port)}` }, options);
  }

  /**
   * The preview URL of a port (`http://{port}-{id}.{suffix}`). A port that
   * is neither listening nor labelled is labelled first, so it is listed.
   */
  async previewUrl(port: number, options: RequestOptions = {}): Promise<string> {
    const known = (await this.list(options)).find((p) => p.port === port);
    return (known ?? (await this.add(port, options))).previewUrl;
  }

  /**
   * A signed token that opens the sandbox's preview hosts (needed when it
   * has `previewAuth`): for one port, or every port when none is given.
   */
  async createPreviewToken(options: RequestOptions & { port?: number; ttlSeconds?: number } = {}): Promise<PreviewToken> {
    const json: Record<string, number> = {};
    if (options.port !== undefined) json['port'] = options.port;
    if (options.ttlSeconds !== undefined) json['ttl_seconds'] = options.ttlSeconds;
    return fromWire<PreviewToken>('PreviewToken', await this.transport.json({ method: 'POST', path: `${this.path}/preview-token`, json }, options));
  }
}
