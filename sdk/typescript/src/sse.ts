/**
 * Server-sent events off a fetch Response (§2.8 of the wire contract):
 * `event:` and `data:` lines, a blank line ends an event, comments
 * (`: ping`) are keep-alives. Leaving the loop early cancels the body,
 * which closes the connection: the server then stops what it streams.
 */

import { AbortError, APIConnectionError, CladeError } from './errors.js';

export interface ServerSentEvent {
  /** `message` when the event named none. */
  event: string;
  data: string;
}

/** The events of `response`'s body, in order. */
export async function* parseEvents(response: Response, signal?: AbortSignal): AsyncGenerator<ServerSentEvent> {
  let event = '';
  let data: string[] = [];
  for await (const line of readLines(response, signal)) {
    if (line === '') {
      if (data.length > 0 || event) yield { event: event || 'message', data: data.join('\n') };
      event = '';
      data = [];
      continue;
    }
    if (line.startsWith(':')) continue;
    const colon = line.indexOf(':');
    const field = colon === -1 ? line : line.slice(0, colon);
    let value = colon === -1 ? '' : line.slice(colon + 1);
    if (value.startsWith(' ')) value = value.slice(1);
    if (field === 'event') event = value;
    else if (field === 'data') data.push(value);
  }
  if (data.length > 0) yield { event: event || 'message', data: data.join('\n') };
}

/** The body's lines (LF or CRLF), decoded as UTF-8 across chunk boundaries. */
async function* readLines(response: Response, signal?: AbortSignal): AsyncGenerator<string> {
  const body = response.body;
  if (!body) return;
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let pending = '';
  try {
    for (;;) {
      let chunk: ReadableStreamReadResult<Uint8Array>;
      try {
        chunk = await reader.read();
      } catch (error) {
        throw streamFailure(error, signal);
      }
      if (chunk.done) break;
      pending += decoder.decode(chunk.value, { stream: true });
      let newline: number;
      while ((newline = pending.indexOf('\n')) !== -1) {
        const line = pending.slice(0, newline).replace(/\r$/, '');
        pending = pending.slice(newline + 1);
        yield line;
      }
    }
    pending += decoder.decode();
    if (pending) yield pending;
  } finally {
    // Early exit (break, return, throw): closing the body closes the connection.
    await reader.cancel().catch(() => undefined);
  }
}

/** An error while reading a body, as the SDK's error. */
export function streamFailure(error: unknown, signal?: AbortSignal): CladeError {
  if (error instanceof CladeError) return error;
  if (signal?.aborted) return new AbortError('the stream was aborted', { cause: signal.reason });
  return new APIConnectionError(`the stream broke: ${error instanceof Error ? error.message : String(error)}`, { cause: error });
}
