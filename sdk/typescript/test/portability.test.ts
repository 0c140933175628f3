/**
 * The core runs on Node 18+, Bun and Deno: it uses web APIs only (fetch,
 * web streams, AbortController, TextEncoder, atob). `node:` modules are
 * imported only dynamically, by the local-file helpers and the config-file
 * reader, behind a check. The source is read here for Node-only names.
 */

import assert from 'node:assert/strict';
import { readdirSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { describe, test } from 'node:test';
import { REPO } from './server.js';

const SRC = join(REPO, 'sdk', 'typescript', 'src');
/** The only files that may reach for `node:` (dynamically, guarded), and what for. */
const DYNAMIC_NODE_IMPORTS: Record<string, string[]> = {
  'bytes.ts': ['node:fs'],
  'settings.ts': ['node:fs/promises'],
};

function sources(dir: string, prefix = ''): { name: string; code: string }[] {
  return readdirSync(dir, { withFileTypes: true }).flatMap((entry) =>
    entry.isDirectory()
      ? sources(join(dir, entry.name), `${prefix}${entry.name}/`)
      : entry.name.endsWith('.ts')
        ? [{ name: `${prefix}${entry.name}`, code: withoutComments(readFileSync(join(dir, entry.name), 'utf8')) }]
        : [],
  );
}

/** The code without its comments (block comments, and `//` lines), so prose does not count. */
function withoutComments(code: string): string {
  return code.replace(/\/\*[\s\S]*?\*\//g, '').replace(/^\s*\/\/.*$/gm, '');
}

describe('portability', () => {
  test('the source imports no node: module statically and uses no Node-only global', () => {
    const problems: string[] = [];
    for (const { name, code } of sources(SRC)) {
      for (const match of code.matchAll(/(?:^|\n)\s*(?:import|export)\s[^;]*?from\s+['"](node:[^'"]+|[a-z@][^'"]*)['"]/g)) {
        problems.push(`${name}: a static import of ${match[1]} (the SDK has no dependencies and imports node: modules only dynamically)`);
      }
      const dynamic = [...code.matchAll(/import\(\s*['"]([^'"]+)['"]\s*\)/g)].map((m) => m[1]!).filter((m) => !m.startsWith('.'));
      const allowed = DYNAMIC_NODE_IMPORTS[name] ?? [];
      for (const module of dynamic) {
        if (!allowed.includes(module)) problems.push(`${name}: import('${module}') (allowed only in ${Object.keys(DYNAMIC_NODE_IMPORTS).join(', ')})`);
      }
      for (const global of ['Buffer', 'require', '__dirname', '__filename', 'setImmediate', 'process', 'global', 'NodeJS']) {
        // A bare use: not a property (`g.process?.env` reads it off globalThis, guarded) nor a property's key.
        if (new RegExp(`(?<![.\\w'"\`])${global}\\b(?!['"\`]|\\??\\s*:)`).test(code)) problems.push(`${name}: uses ${global}`);
      }
    }
    assert.deepEqual(problems, []);
  });
});
