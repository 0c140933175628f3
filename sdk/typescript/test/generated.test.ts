/** The SDK follows docs/openapi.json: its generated types are current, and every operation has a method (or a reason not to). */

import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';
import { describe, test } from 'node:test';
import { Clade, CodeContext, EXCLUDED_OPERATIONS, OPERATIONS, Sandbox } from '../src/index.js';
import { REPO } from './server.js';

const SDK = join(REPO, 'sdk', 'typescript');
const openapi = JSON.parse(readFileSync(join(REPO, 'docs', 'openapi.json'), 'utf8')) as {
  paths: Record<string, Record<string, { operationId?: string }>>;
};

function operationIds(): string[] {
  return Object.values(openapi.paths).flatMap((methods) =>
    Object.values(methods).flatMap((op) => (op && typeof op === 'object' && op.operationId ? [op.operationId] : [])),
  );
}

describe('the generated types', () => {
  test('src/generated/openapi.ts is what scripts/generate-types.mjs makes of docs/openapi.json', async () => {
    const generator = (await import(pathToFileURL(join(SDK, 'scripts', 'generate-types.mjs')).href)) as { generate(doc: unknown): string };
    const committed = readFileSync(join(SDK, 'src', 'generated', 'openapi.ts'), 'utf8');
    assert.ok(
      generator.generate(openapi) === committed,
      'src/generated/openapi.ts is stale: run `node scripts/generate-types.mjs` in sdk/typescript and commit the result',
    );
  });
});

describe('operation coverage', () => {
  test('every operationId of docs/openapi.json is an SDK method or excluded with a reason', () => {
    const missing = operationIds().filter((id) => !(id in OPERATIONS) && !(id in EXCLUDED_OPERATIONS));
    assert.deepEqual(missing, [], `operations the TypeScript SDK does not cover: add them to src/operations.ts`);
  });

  test('the tables name no operation the document lacks, and none twice', () => {
    const ids = new Set(operationIds());
    const stale = [...Object.keys(OPERATIONS), ...Object.keys(EXCLUDED_OPERATIONS)].filter((id) => !ids.has(id));
    assert.deepEqual(stale, []);
    const both = Object.keys(OPERATIONS).filter((id) => id in EXCLUDED_OPERATIONS);
    assert.deepEqual(both, []);
  });

  test('every method the table names exists', () => {
    const clade = new Clade({ baseUrl: 'http://127.0.0.1:9', apiKey: 'k' });
    const info = { id: 'sb', template: 'base', cpu: 1, memoryMb: 512, status: 'running', createdAt: '', metadata: {}, persistent: false, ttlSeconds: 0, previewAuth: false };
    const sandbox = new Sandbox((clade as unknown as { transport: never }).transport, info);
    const codeContext = new CodeContext((clade as unknown as { transport: never }).transport, { id: 'c', sandboxId: 'sb', language: 'python', createdAt: '' });
    const roots: Record<string, unknown> = { client: clade, sandbox, codeContext };
    for (const [operation, path] of Object.entries(OPERATIONS)) {
      const [root, ...names] = path.split('.');
      let target: unknown = roots[root!];
      for (const name of names) target = (target as Record<string, unknown> | undefined)?.[name];
      assert.equal(typeof target, 'function', `${operation} → ${path} is not a method`);
    }
  });
});
