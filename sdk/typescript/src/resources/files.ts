/** A sandbox's filesystem: `/v1/sandboxes/{id}/fs…`. Streams both ways, any size. */

import { localFileStream, toBody, writeLocalFile, type FileContent } from '../bytes.js';
import { seg, type RequestOptions, type Transport } from '../http.js';
import type { FileEntry, WriteInfo } from '../models.js';
import { NotFoundError } from '../errors.js';
import { fromWire } from '../wire.js';

export interface ReadOptions extends RequestOptions {
  /** `text` (UTF-8, the default), `bytes`, or `stream` (a ReadableStream read as it comes). */
  format?: 'text' | 'bytes' | 'stream';
}

export class Files {
  constructor(
    private readonly transport: Transport,
    private readonly sandboxId: string,
  ) {}

  private get path(): string {
    return `/v1/sandboxes/${seg(this.sandboxId)}/fs`;
  }

  /** A file's contents: text by default; `format: 'bytes'` or `'stream'` for binary or large files. */
  read(path: string, options?: ReadOptions & { format?: 'text' }): Promise<string>;
  read(path: string, options: ReadOptions & { format: 'bytes' }): Promise<Uint8Array>;
  read(path: string, options: ReadOptions & { format: 'stream' }): Promise<ReadableStream<Uint8Array>>;
  async read(path: string, options: ReadOptions = {}): Promise<string | Uint8Array | ReadableStream<Uint8Array>> {
    const response = await this.transport.stream({ method: 'GET', path: this.path, query: { path } }, options);
    switch (options.format ?? 'text') {
      case 'stream':
        return response.body ?? new ReadableStream<Uint8Array>({ start: (c) => c.close() });
      case 'bytes':
        return new Uint8Array(await response.arrayBuffer());
      default:
        return response.text();
    }
  }

  /**
   * Writes a file (parent directories are created): text, bytes, a Blob, or a
   * stream / AsyncIterable of bytes, sent as it is read. A stream is sent
   * once: such a write is not retried.
   */
  async write(path: string, content: FileContent, options: RequestOptions = {}): Promise<WriteInfo> {
    const body = toBody(content);
    const answer = await this.transport.json(
      { method: 'PUT', path: this.path, query: { path }, body, contentType: 'application/octet-stream' },
      options,
    );
    return fromWire<WriteInfo>('Written', answer);
  }

  /** Uploads the local file `localPath` (Node, Bun, Deno) to `remotePath`, streamed. */
  async upload(localPath: string, remotePath: string, options: RequestOptions = {}): Promise<WriteInfo> {
    return this.write(remotePath, await localFileStream(localPath), options);
  }

  /** Downloads `remotePath` to the local file `localPath` (Node, Bun, Deno), streamed; the bytes written. */
  async download(remotePath: string, localPath: string, options: RequestOptions = {}): Promise<{ path: string; bytes: number }> {
    const stream = await this.read(remotePath, { ...options, format: 'stream' });
    return { path: localPath, bytes: await writeLocalFile(localPath, stream) };
  }

  /** A directory's entries, sorted by name. */
  async list(path: string, options: RequestOptions = {}): Promise<FileEntry[]> {
    const answer = await this.transport.json<{ entries: unknown[] }>({ method: 'GET', path: `${this.path}/dir`, query: { path } }, options);
    return fromWire<FileEntry[]>('FileEntry', answer.entries);
  }

  /** A path's metadata (it is not followed if it is a link). */
  async stat(path: string, options: RequestOptions = {}): Promise<FileEntry> {
    return fromWire<FileEntry>('FileEntry', await this.transport.json({ method: 'GET', path: `${this.path}/stat`, query: { path } }, options));
  }

  /** Whether the path exists. */
  async exists(path: string, options: RequestOptions = {}): Promise<boolean> {
    try {
      await this.stat(path, options);
      return true;
    } catch (error) {
      if (error instanceof NotFoundError) return false;
      throw error;
    }
  }

  /** Removes a file or a directory with its contents (nothing to remove is no error). */
  async remove(path: string, options: RequestOptions = {}): Promise<void> {
    await this.transport.json({ method: 'DELETE', path: this.path, query: { path } }, options);
  }
}
