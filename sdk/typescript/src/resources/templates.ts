/** `client.templates`: what sandboxes are made from, and builds of the workspace's own. */

import { CladeError } from '../errors.js';
import { seg, type RequestOptions, type Transport } from '../http.js';
import type { Template, TemplateBuild } from '../models.js';
import { streamOf } from '../sandbox.js';
import { fromWire } from '../wire.js';

export interface BuildParams {
  /** The template's name. */
  name: string;
  /** Dockerfile text (`FROM` a template or an OCI reference). */
  dockerfile?: string;
  /** The Dockerfile's context: relative path → content (≤ 50 MiB in all). */
  context?: Record<string, string | Uint8Array | Blob>;
  /** An OCI image reference the server pulls. */
  imageRef?: string;
  /** A root filesystem tarball (or `docker save` / OCI layout archive). */
  rootfs?: Blob | Uint8Array;
  sizeMb?: number;
  cpu?: number;
  memoryMb?: number;
  /** Replace the workspace's own template of that name. */
  replace?: boolean;
}

const blobOf = (content: string | Uint8Array | Blob): Blob => (content instanceof Blob ? content : new Blob([content as BlobPart]));

export class TemplateBuilds {
  constructor(private readonly transport: Transport) {}

  /** The workspace's builds, newest first. */
  async list(options: RequestOptions = {}): Promise<TemplateBuild[]> {
    return fromWire<TemplateBuild[]>('TemplateBuild', await this.transport.json({ method: 'GET', path: '/v1/templates/builds' }, options));
  }

  async get(id: string, options: RequestOptions = {}): Promise<TemplateBuild> {
    return fromWire<TemplateBuild>('TemplateBuild', await this.transport.json({ method: 'GET', path: `/v1/templates/builds/${seg(id)}` }, options));
  }

  /**
   * The build's log lines; with `follow` (the default), as they come until
   * the build ends. Leaving the loop early closes the connection.
   */
  logs(id: string, options: RequestOptions & { follow?: boolean } = {}): AsyncIterable<string> {
    const request = {
      method: 'GET' as const,
      path: `/v1/templates/builds/${seg(id)}/logs`,
      query: { follow: options.follow === false ? undefined : 1 },
      accept: 'text/event-stream',
    };
    return streamOf(this.transport, request, { ...options, timeoutMs: undefined }, (event) => (event.event === 'message' ? event.data : undefined));
  }

  /**
   * Cancels a queued or running build: its work stops, no template is
   * published, and it ends `failed` ("cancelled by request"). One that has
   * already ended is a ConflictError.
   */
  async cancel(id: string, options: RequestOptions = {}): Promise<TemplateBuild> {
    return fromWire<TemplateBuild>('TemplateBuild', await this.transport.json({ method: 'DELETE', path: `/v1/templates/builds/${seg(id)}` }, options));
  }

  /**
   * Waits until the build is `done` or `failed` (polling every
   * `intervalMs`); its final state. Aborting the signal cancels the build
   * too (the build is what is being waited for), unless `cancelOnAbort` is
   * false.
   */
  async wait(id: string, options: RequestOptions & { intervalMs?: number; deadlineMs?: number; cancelOnAbort?: boolean } = {}): Promise<TemplateBuild> {
    const deadline = Date.now() + (options.deadlineMs ?? 30 * 60_000);
    try {
      for (;;) {
        const build = await this.get(id, options);
        if (build.status === 'done' || build.status === 'failed') return build;
        if (Date.now() > deadline) throw new CladeError(`build ${id} is still ${build.status}`);
        await pause(options.intervalMs ?? 1000, options.signal);
      }
    } catch (error) {
      if (options.signal?.aborted && options.cancelOnAbort !== false) {
        // Not under the aborted signal: the cancel must still go out.
        await this.cancel(id, { ...options, signal: undefined }).catch(() => undefined);
      }
      throw error;
    }
  }
}

/** Waits `ms`, or less when the signal aborts (the AbortError is the caller's next call's to raise). */
function pause(ms: number, signal: AbortSignal | undefined): Promise<void> {
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer);
      signal?.removeEventListener('abort', done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    signal?.addEventListener('abort', done, { once: true });
  });
}

export class Templates {
  readonly builds: TemplateBuilds;

  constructor(private readonly transport: Transport) {
    this.builds = new TemplateBuilds(transport);
  }

  async list(options: RequestOptions = {}): Promise<Template[]> {
    return fromWire<Template[]>('Template', await this.transport.json({ method: 'GET', path: '/v1/templates' }, options));
  }

  async get(name: string, options: RequestOptions = {}): Promise<Template> {
    return fromWire<Template>('Template', await this.transport.json({ method: 'GET', path: `/v1/templates/${seg(name)}` }, options));
  }

  /** Deletes one of the workspace's own templates (global ones are a PermissionDeniedError). */
  async delete(name: string, options: RequestOptions = {}): Promise<void> {
    await this.transport.json({ method: 'DELETE', path: `/v1/templates/${seg(name)}` }, options);
  }

  /** Starts a build (queued); follow it with `builds.logs(build.id)` and `builds.wait(build.id)`. */
  async build(params: BuildParams, options: RequestOptions = {}): Promise<TemplateBuild> {
    const form = new FormData();
    form.append('name', params.name);
    if (params.dockerfile !== undefined) form.append('dockerfile', params.dockerfile);
    if (params.imageRef !== undefined) form.append('image_ref', params.imageRef);
    if (params.sizeMb !== undefined) form.append('size_mb', String(params.sizeMb));
    if (params.cpu !== undefined) form.append('cpu', String(params.cpu));
    if (params.memoryMb !== undefined) form.append('memory_mb', String(params.memoryMb));
    if (params.replace !== undefined) form.append('replace', String(params.replace));
    for (const [path, content] of Object.entries(params.context ?? {})) {
      if (path.startsWith('/') || path.split('/').includes('..')) throw new CladeError(`context file ${path}: a relative path inside the context`);
      form.append(path, blobOf(content), path);
    }
    if (params.rootfs !== undefined) form.append('rootfs', blobOf(params.rootfs), 'rootfs.tar');
    const answer = await this.transport.json({ method: 'POST', path: '/v1/templates/build', body: form }, options);
    return fromWire<TemplateBuild>('TemplateBuild', answer);
  }
}

