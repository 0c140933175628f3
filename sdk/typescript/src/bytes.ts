/**
 * Bodies of file transfers: what a caller may hand the SDK (text, bytes, a
 * Blob, a web ReadableStream, any AsyncIterable of bytes such as a Node
 * stream) turned into a fetch body without reading a stream into memory;
 * and local files on runtimes that have `node:fs` (Node, Bun, Deno).
 */

import { CladeError } from './errors.js';

/** Anything a file can be written from. */
export type FileContent = string | Uint8Array | ArrayBuffer | Blob | ReadableStream<Uint8Array> | AsyncIterable<Uint8Array>;

/** A fetch body for `content`: streams stay streams. */
export function toBody(content: FileContent): Uint8Array | Blob | ReadableStream<Uint8Array> {
  if (typeof content === 'string') return new TextEncoder().encode(content);
  if (content instanceof Uint8Array) return content;
  if (content instanceof ArrayBuffer) return new Uint8Array(content);
  if (typeof Blob !== 'undefined' && content instanceof Blob) return content;
  if (content instanceof ReadableStream) return content;
  if (isAsyncIterable(content)) return iterableToStream(content);
  throw new CladeError('file content must be a string, Uint8Array, ArrayBuffer, Blob, ReadableStream or AsyncIterable<Uint8Array>');
}

function isAsyncIterable(value: unknown): value is AsyncIterable<Uint8Array> {
  return value !== null && typeof value === 'object' && Symbol.asyncIterator in value;
}

/** A ReadableStream that pulls from `source` only as fast as it is read. */
export function iterableToStream(source: AsyncIterable<Uint8Array>): ReadableStream<Uint8Array> {
  const iterator = source[Symbol.asyncIterator]();
  return new ReadableStream<Uint8Array>({
    async pull(controller) {
      try {
        const { value, done } = await iterator.next();
        if (done) controller.close();
        else controller.enqueue(value instanceof Uint8Array ? value : new Uint8Array(value as ArrayBufferLike));
      } catch (error) {
        controller.error(error);
      }
    },
    async cancel(reason) {
      await iterator.return?.(reason);
    },
  });
}

/** The chunks of a ReadableStream, cancelling it when the loop ends early. */
export async function* streamChunks(stream: ReadableStream<Uint8Array>): AsyncGenerator<Uint8Array> {
  const reader = stream.getReader();
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      yield value;
    }
  } finally {
    await reader.cancel().catch(() => undefined);
  }
}

type NodeFs = typeof import('node:fs');

/** `node:fs`, on runtimes that have it. */
export async function nodeFs(): Promise<NodeFs> {
  try {
    return await import('node:fs');
  } catch (error) {
    throw new CladeError('local file paths need node:fs (Node, Bun or Deno); pass the content as a stream instead', { cause: error });
  }
}

/** A local file as a stream read as it is sent. */
export async function localFileStream(path: string): Promise<ReadableStream<Uint8Array>> {
  const fs = await nodeFs();
  await fs.promises.access(path, fs.constants.R_OK);
  return iterableToStream(fs.createReadStream(path, { highWaterMark: 1 << 20 }) as AsyncIterable<Uint8Array>);
}

/** Writes `stream` to the local file `path` chunk by chunk; the bytes written. */
export async function writeLocalFile(path: string, stream: ReadableStream<Uint8Array>): Promise<number> {
  const fs = await nodeFs();
  const file = await fs.promises.open(path, 'w');
  let written = 0;
  try {
    for await (const chunk of streamChunks(stream)) {
      let offset = 0;
      while (offset < chunk.length) {
        const { bytesWritten } = await file.write(chunk, offset, chunk.length - offset);
        offset += bytesWritten;
      }
      written += chunk.length;
    }
  } finally {
    await file.close();
  }
  return written;
}

/** Base64 to bytes, without Node's Buffer. */
export function decodeBase64(text: string): Uint8Array {
  const binary = atob(text.replace(/\s+/g, ''));
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return bytes;
}

/** Bytes (or text, as UTF-8) to base64, without Node's Buffer. */
export function encodeBase64(content: string | Uint8Array): string {
  const bytes = typeof content === 'string' ? new TextEncoder().encode(content) : content;
  let binary = '';
  // In slices: String.fromCharCode takes its bytes as arguments, and a call has a limit of them.
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}
