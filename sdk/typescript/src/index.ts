/**
 * `@clade/sdk`: Clade's TypeScript SDK. Zero runtime dependencies (the
 * platform's fetch, web streams, AbortController): Node 18+, Bun, Deno.
 *
 *     import { Clade } from '@clade/sdk';
 *     const client = new Clade();              // CLADE_API_URL, CLADE_API_KEY
 *     await using sb = await client.sandboxes.create();
 *     console.log((await sb.exec('uname -a')).stdout);
 */

import './dispose.js';

export { Clade, DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT_MS, type ClientOptions } from './client.js';
export { Sandbox, shellQuote, type ExecOptions, type ForkOptions, type ForkTree } from './sandbox.js';
export { Files, type ReadOptions } from './resources/files.js';
export { Ports } from './resources/ports.js';
export { CodeContext, CodeContexts, type Language, type RunCodeOptions } from './resources/code.js';
export { Sandboxes } from './resources/sandboxes.js';
export { Snapshots } from './resources/snapshots.js';
export { Templates, TemplateBuilds, type BuildParams } from './resources/templates.js';
export { Volumes } from './resources/volumes.js';
export { Keys } from './resources/keys.js';
export { Databases, DATABASE_DEADLINE_MS, type DatabaseCreateOptions, type DatabaseWaitOptions, type QueryOptions } from './resources/databases.js';
export {
  Functions,
  FUNCTION_DEPLOY_DEADLINE_MS,
  type FunctionCreateOptions,
  type FunctionDeployOptions,
  type FunctionWaitOptions,
} from './resources/functions.js';
export { Schedules } from './resources/schedules.js';
export { Apps, type AppDeployOptions, type AppEnvOptions } from './resources/apps.js';
export type { RequestOptions } from './http.js';
export type { FileContent } from './bytes.js';
export { DEFAULT_API_URL, type ResolvedSettings } from './settings.js';
export { OPERATIONS, EXCLUDED_OPERATIONS } from './operations.js';
export * from './errors.js';
export type * from './models.js';
export type * as api from './generated/openapi.js';
