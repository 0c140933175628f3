/**
 * A loopback HTTP proxy between the SDK and the server, for the retry
 * tests: it answers the first requests itself (503, 429 or 409, with
 * Retry-After or without), or forwards a request and then drops the connection
 * without answering, and forwards everything else.
 */

import { createServer, request as httpRequest, type IncomingMessage, type Server, type ServerResponse } from 'node:http';

export type Mode =
  | { kind: 'refuse'; status: 503 | 429 | 409; times: number; retryAfter?: string; method?: string }
  | { kind: 'drop-after-forwarding'; method: string; path: string; times: number };

const REFUSALS = {
  503: 'no capacity (test proxy)',
  429: 'rate limited (test proxy)',
  409: 'a request with this Idempotency-Key is in progress (test proxy)',
};

export interface Proxy {
  url: string;
  /** Every request that reached the proxy: method, path, Idempotency-Key, when. */
  seen: { method: string; path: string; idempotencyKey: string | undefined; at: number }[];
  close(): Promise<void>;
}

export async function startProxy(target: string, mode: Mode): Promise<Proxy> {
  const upstream = new URL(target);
  const seen: Proxy['seen'] = [];
  let left = mode.times;
  const server: Server = createServer((req: IncomingMessage, res: ServerResponse) => {
    const path = req.url ?? '/';
    seen.push({ method: req.method ?? '', path, idempotencyKey: req.headers['idempotency-key'] as string | undefined, at: Date.now() });
    if (mode.kind === 'refuse' && left > 0 && (!mode.method || mode.method === req.method)) {
      left--;
      req.resume();
      const headers: Record<string, string> = { 'Content-Type': 'application/json', 'X-Request-Id': 'proxy' };
      if (mode.retryAfter !== undefined) headers['Retry-After'] = mode.retryAfter;
      res.writeHead(mode.status, headers);
      res.end(JSON.stringify({ error: REFUSALS[mode.status], request_id: 'proxy' }));
      return;
    }
    const drop = mode.kind === 'drop-after-forwarding' && left > 0 && req.method === mode.method && path.split('?')[0] === mode.path;
    if (drop) left--;
    const forward = httpRequest(
      { host: upstream.hostname, port: upstream.port, method: req.method, path, headers: req.headers },
      (answer) => {
        if (drop) {
          // The server acted and answered; the client never hears of it.
          answer.resume();
          answer.on('end', () => req.socket.destroy());
          return;
        }
        res.writeHead(answer.statusCode ?? 502, answer.headers);
        answer.pipe(res);
      },
    );
    forward.on('error', () => res.destroy());
    req.pipe(forward);
  });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const address = server.address();
  const port = typeof address === 'object' && address ? address.port : 0;
  return {
    url: `http://127.0.0.1:${port}`,
    seen,
    close: () =>
      new Promise<void>((resolve) => {
        server.closeAllConnections();
        server.close(() => resolve());
      }),
  };
}
