/**
 * The SDK's public data types. Most are the generated interfaces of
 * docs/openapi.json's schemas (camelCase); the rest shape what the API
 * sends as free-form JSON (MIME bundles, stream events).
 */

import type * as api from './generated/openapi.js';

export type SandboxInfo = api.Sandbox;
export type SandboxDisk = api.SandboxDisk;
export type SandboxPatch = api.SandboxPatch;
export type ExecBody = api.ExecBody;
export type ExecResult = api.ExecResult;
export type Truncated = api.Truncated;
export type FileEntry = api.FileEntry;
export type DirListing = api.DirListing;
export type WriteInfo = api.Written;
export type Snapshot = api.Snapshot;
export type Template = api.Template;
export type TemplateBuild = api.TemplateBuild;
export type Volume = api.Volume;
export type VolumeAttachment = api.VolumeAttachment;
export type Attachment = api.Attachment;
export type NetworkPolicy = api.NetworkPolicy;
export type NetworkStatus = api.NetworkStatus;
export type TrafficCounters = api.TrafficCounters;
export type Limits = api.Limits;
export type LifecycleSettings = api.LifecycleSettings;
export type LifecyclePatch = api.LifecyclePatch;
export type LifecycleStatus = api.LifecycleStatus;
export type PortInfo = api.PortInfo;
export type PreviewToken = api.PreviewToken;
export type SandboxEvent = api.Event;
export type Me = api.Me;
export type WorkspaceRef = api.WorkspaceRef;
export type CodeContextInfo = api.CodeContext;
export type PromoteResult = api.PromoteResult;
export type ChildError = api.ChildError;
export type Health = api.Health;
export type Version = api.Version;
/** An API key of the workspace (its secret `token` only in the answer of a create; `expiresAt` null: valid until revoked). */
export type ApiKey = api.Token;
/** What a key is created with: a label, and `expiresInDays` (1 to 3650; absent: valid until revoked). */
export type CreateKeyParams = api.CreateToken;
/**
 * What a sandbox is created with; every field is optional (`base`, no
 * metadata, the server's TTL, the internet and nothing private). A
 * `persistent` sandbox is hibernated when idle instead of deleted, and is
 * kept at the end of an `await using` block.
 */
export type CreateSandboxParams = api.CreateSandboxBody;
/** What a volume is created with: its name and size (MiB, 16 to 65536; 256 by default). */
export type CreateVolumeParams = api.CreateVolumeBody & { name: string };
/**
 * A managed PostgreSQL database. Its credentials (`connectionUrl`,
 * `password`, `brokerToken`…) are there once it is ready, never in lists.
 */
export type DatabaseInfo = api.DatabaseInfo;
/** How to reach a ready database: its `connectionUrl`, and the HTTP broker's URL and token. */
export type ConnectionInfo = api.ConnectionInfo;
/** What a statement run through the broker answered: its columns, rows (JSON values by column type), count and command tag. */
export type QueryResult = api.QueryResult;
/** A column of a {@link QueryResult}: its name and PostgreSQL's name of its type (`int4`, `text`…). */
export type QueryColumn = api.Column;
/**
 * What a database is made with; every field is optional: `size` `1g`
 * (512 MiB of memory and a 4 GiB disk, the default), `4g` (1 GiB, 6 GiB)
 * or `16g` (2 GiB, 18 GiB); `cpu` (1 to 8) and `memoryMb` (256 to 16384)
 * override the memory; `alwaysOn`: never idled into hibernation.
 */
export type CreateDatabaseParams = api.CreateDatabaseBody;
/**
 * What a clone is made with: a `label` (`<label> (clone)` by default), and
 * `targetTime` (RFC 3339) for the source as it was then. A clone keeps its
 * source's `size` (another is a BadRequestError).
 */
export type CloneDatabaseParams = api.CloneBody;
/** What a database's settings are changed with: `alwaysOn`, never idled into hibernation. */
export type UpdateDatabaseParams = api.PatchDatabaseBody;

/**
 * A function: code the server keeps and deploys as a snapshot of a sandbox
 * with its dependencies installed. `status` is `empty` (no code yet),
 * `deploying`, `ready` or `failed` (`error` and `deployLog` say why; the
 * version before it still runs).
 */
export type FunctionInfo = api.FunctionInfo;
/**
 * One run of a function: `status` `running`, `success`, `error`, `timeout`
 * or `skipped` (a scheduled run the servers missed); `output` is what the
 * handler returned (JSON), `stdout` and `stderr` what it printed.
 */
export type FunctionRun = api.FunctionRun;
/** A function's runs over a period: latency percentiles (nearest rank), error rate and cold-start rate. */
export type FunctionMetrics = api.Metrics;
/**
 * What a function is made with. `runtime` is `python` or `nodejs`;
 * `code` is the entrypoint's content (text, or bytes: a file's, or a
 * tar.gz's), at most 512 KiB; without it, `deploy` code later.
 * `entrypoint` is `handler.py` / `handler.js` by default, `template`
 * `code-interpreter`; `timeoutSeconds` a run's limit (1 to 900, 300 by
 * default); `public` answers HTTP at its `url` without a key.
 */
export type CreateFunctionParams = Omit<api.CreateFunctionBody, 'code'> & { code?: string | Uint8Array | undefined };
/** What a function's settings are changed with; a new `entrypoint` or `template` deploys it again. */
export type UpdateFunctionParams = api.PatchFunctionBody;
/** A run made elsewhere, recorded in the function's runs (nothing is executed): `status` `success`, `error`, `timeout` or `running`. */
export type RecordRunParams = api.RecordRunBody;
/** A cron schedule of a function; `nextRunAt` is absent while it is paused. */
export type ScheduleInfo = api.ScheduleInfo;
/**
 * What a schedule is made with: a `name` unique in the workspace, the
 * function (`functionId`: its id or name), `cron` (five fields or
 * `@hourly`…), `timezone` (IANA, `UTC` by default), `paused`, and the
 * `input` each run gets.
 */
export type CreateScheduleParams = api.CreateScheduleBody;
/** What a schedule is changed with (`input: null` removes its input; a resume sets its next run from now). */
export type UpdateScheduleParams = api.PatchScheduleBody;

/**
 * An app: a service deployed from git that answers at its host name
 * `{name}.{suffix}`. `status` is `created` (never deployed), `deploying`,
 * `live` or `failed`; `url`, `activeDeploymentId` and `sandboxId` are the
 * live deployment's; `env` holds its variables, secrets masked.
 */
export type AppInfo = api.AppInfo;
/**
 * A deployment of an app: `status` `queued`, `building`, `deploying`, then
 * `live`, `failed` (`error` says why), `superseded` (a newer one went
 * live) or `rolled_back`. `buildLogs` only in `apps.deployment`.
 */
export type DeploymentInfo = api.DeploymentInfo;
/**
 * What an app is made with: its `name` (its host name's first label, 1 to
 * 40 lowercase letters, digits and `-`, unique on the server) and
 * `gitUrl` (https, http, ssh or `user@host:path`; `file://` only where
 * the server allows it). Optional: `gitBranch` (`main`), `framework`
 * (`nextjs`, `vite`, `node`, `python`, `static`, `custom`; absent:
 * detected at each deployment), `installCommand`, `buildCommand`,
 * `startCommand` (run with `$PORT` set), `rootDirectory`, `port` (3000),
 * `env` (plain variables), `template` (the framework's), `cpu`,
 * `memoryMb`, `autoHibernate` with `idleTimeoutSeconds` (10 to 604800,
 * 600 by default), `keepDeployments` (kept for a rollback, 0 to 20, 3 by
 * default).
 */
export type CreateAppParams = api.AppBody & { name: string; gitUrl: string };
/** What an app's settings are changed with: each field given replaces the app's, from its next deployment. */
export type UpdateAppParams = api.AppBody;
/** One variable of an app: `value` masked (`••••••••`) when it is a `secret`; `scope` `all`, `production` or `preview`. */
export type AppEnvVar = api.AppEnvVar;
/** What setting an app's variable answers: its `key`, whether it is a `secret`, its `scope`. */
export type AppEnvSet = api.AppEnvSet;
/** What a `.env` import answers: the variables it set (`imported`) and how many the app has now (`total`). */
export type AppEnvImported = api.AppEnvImported;

/** A database's figures, as its own server counts them. */
export interface DatabaseStats {
  /** The server's whole version, e.g. `15.10 (Debian 15.10-0+deb12u1)`. */
  postgresVersion: string;
  dbSizeBytes: number;
  /** Sessions open now, the query that counted them not included. */
  connections: number;
  maxConnections: number;
}

/** One event of a streamed command, in order: output chunks, then `exit` (or `error`). */
export type ExecEvent =
  | { type: 'stdout'; data: string }
  | { type: 'stderr'; data: string }
  | { type: 'exit'; exitCode: number }
  | { type: 'error'; error: string };

/**
 * One rich result of a code cell (a display, or the last expression's
 * value): a MIME bundle with the common formats decoded.
 */
export interface CodeResult {
  /** `text/plain`. */
  text?: string;
  /** `text/html` (a DataFrame, for one). */
  html?: string;
  /** `text/markdown`. */
  markdown?: string;
  /** `image/svg+xml`. */
  svg?: string;
  /** `image/png`, decoded from base64. */
  png?: Uint8Array;
  /** `image/jpeg`, decoded from base64. */
  jpeg?: Uint8Array;
  /** `application/json`, parsed. */
  json?: unknown;
  /** `application/javascript`. */
  javascript?: string;
  /** The bundle as the server sent it: MIME type → string (images in base64). */
  raw: Record<string, string>;
  /** The MIME types it has. */
  formats: string[];
}

/** A cell's outcome. */
export interface Execution {
  stdout: string;
  stderr: string;
  /** 0, or 1 when the cell raised or was interrupted (bash: its status). */
  exitCode: number;
  durationMs: number;
  /** The formatted traceback (or `Name: value`) when the cell raised. */
  error: string | null;
  results: CodeResult[];
  /** Output beyond the cell's limits was dropped. */
  truncated: boolean;
}

/** One event of a streamed cell, in order; `execution` comes last. */
export type CodeEvent =
  | { type: 'stdout'; text: string }
  | { type: 'stderr'; text: string }
  | { type: 'result'; result: CodeResult }
  | { type: 'error'; name: string; value: string; traceback: string }
  | { type: 'execution'; execution: Execution };
