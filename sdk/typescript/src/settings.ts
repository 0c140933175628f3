/**
 * Where the client finds its server and key, as the `clade` CLI does:
 * the constructor's options, then the environment (`CLADE_API_URL`,
 * `CLADE_API_KEY`), then the config file (`CLADE_CONFIG`, else
 * `$XDG_CONFIG_HOME/clade/config.json`, else `~/.config/clade/config.json`,
 * keys `api_url` and `api_key` or `token`; read where `node:fs` exists:
 * Node, Bun, Deno), then the default URL. There is no default key.
 */

import { CladeError } from './errors.js';

export const DEFAULT_API_URL = 'http://127.0.0.1:8080';

export interface ResolvedSettings {
  /** The server's root, without a trailing `/` or `/v1`. */
  baseUrl: string;
  /** Undefined when none was found: only unauthenticated calls work then. */
  apiKey: string | undefined;
}

/** An environment variable on Node, Bun or Deno (undefined where none can be read). */
export function readEnv(name: string): string | undefined {
  const g = globalThis as {
    process?: { env?: Record<string, string | undefined> };
    Deno?: { env?: { get(name: string): string | undefined } };
  };
  try {
    const value = g.process?.env?.[name] ?? g.Deno?.env?.get(name);
    const trimmed = value?.trim();
    return trimmed ? trimmed : undefined;
  } catch {
    return undefined; // Deno without --allow-env
  }
}

interface ConfigFile {
  api_url?: unknown;
  api_key?: unknown;
  token?: unknown;
}

/** The config file's path, from the environment (undefined without a home). */
export function configPath(): string | undefined {
  const explicit = readEnv('CLADE_CONFIG');
  if (explicit) return explicit;
  const xdg = readEnv('XDG_CONFIG_HOME');
  if (xdg) return `${xdg}/clade/config.json`;
  const home = readEnv('HOME');
  return home ? `${home}/.config/clade/config.json` : undefined;
}

/** Whether `node:fs` can be imported: Node and Bun say they are Node; Deno has it too. */
function hasNodeFs(): boolean {
  const g = globalThis as { process?: { versions?: { node?: string } }; Deno?: unknown };
  return typeof g.process?.versions?.node === 'string' || g.Deno !== undefined;
}

async function readConfigFile(): Promise<ConfigFile> {
  const path = configPath();
  if (!path || !hasNodeFs()) return {};
  let text: string;
  try {
    const fs = await import('node:fs/promises');
    text = await fs.readFile(path, 'utf8');
  } catch (error) {
    if ((error as { code?: string }).code === 'ENOENT') return {};
    throw new CladeError(`reading ${path} failed: ${String(error)}`, { cause: error });
  }
  try {
    const parsed: unknown = JSON.parse(text);
    return parsed && typeof parsed === 'object' ? (parsed as ConfigFile) : {};
  } catch (error) {
    throw new CladeError(`${path} is not a JSON object with api_url / api_key`, { cause: error });
  }
}

/** Why a call that needs a key cannot be made. */
export function missingKeyError(): CladeError {
  return new CladeError(
    `no API key: pass { apiKey }, set CLADE_API_KEY, or write {"api_url": "…", "api_key": "clade_…"} to ${configPath() ?? '~/.config/clade/config.json'}`,
  );
}

const text = (value: unknown): string | undefined =>
  typeof value === 'string' && value.trim() ? value.trim() : undefined;

/** `http://h:8080/v1/` → `http://h:8080`: the SDK adds `/v1` itself. */
export function normaliseBaseUrl(url: string): string {
  return url.trim().replace(/\/+$/, '').replace(/\/v1$/, '');
}

export async function resolveSettings(options: { apiKey?: string | undefined; baseUrl?: string | undefined }): Promise<ResolvedSettings> {
  let baseUrl = text(options.baseUrl) ?? readEnv('CLADE_API_URL');
  let apiKey = text(options.apiKey) ?? readEnv('CLADE_API_KEY');
  if (!baseUrl || !apiKey) {
    const file = await readConfigFile();
    baseUrl ??= text(file.api_url);
    apiKey ??= text(file.api_key) ?? text(file.token);
  }
  return { baseUrl: normaliseBaseUrl(baseUrl ?? DEFAULT_API_URL), apiKey };
}
