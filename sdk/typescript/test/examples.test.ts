/** The examples in examples/typescript run against the server, importing the packed @clade/sdk. */

import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { existsSync, mkdtempSync, readFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, test } from 'node:test';
import { client, inCi, server, SKIP } from './helpers.js';

const EXAMPLES = process.env['CLADE_TEST_EXAMPLES'];
const skip = SKIP ?? (EXAMPLES && existsSync(EXAMPLES) ? undefined : 'no packed examples: run scripts/test-sdk-typescript');

function run(script: string, args: string[] = []): Promise<{ code: number | null; stdout: string; stderr: string }> {
  return new Promise((resolve, reject) => {
    const child = spawn(process.execPath, [join(EXAMPLES!, script), ...args], {
      cwd: EXAMPLES,
      env: { ...process.env, CLADE_API_URL: server.url, CLADE_API_KEY: server.key },
    });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (d: Buffer) => (stdout += d.toString()));
    child.stderr.on('data', (d: Buffer) => (stderr += d.toString()));
    child.once('error', reject);
    child.once('close', (code) => resolve({ code, stdout, stderr }));
  });
}

describe('examples', { skip }, () => {
  test('fork-and-pick-best.mjs promotes the child whose fix passes', { timeout: 300_000 }, async () => {
    const before = (await client().sandboxes.list()).length;
    const out = await run('fork-and-pick-best.mjs');
    assert.equal(out.code, 0, `${out.stdout}\n${out.stderr}`);
    assert.match(out.stdout, /winner: s\|\/ len\(values\) \+ 1\|\/ len\(values\)\|/);
    assert.equal((await client().sandboxes.list()).length, before, 'it left no sandbox behind');
  });

  test('data-analysis.mjs saves a PNG chart', { timeout: 300_000 }, async (t) => {
    const templates = await client().templates.list();
    if (!templates.some((x) => x.name === 'code-interpreter' && x.ready)) {
      const reason = 'the code-interpreter template is not built';
      if (inCi()) throw new Error(`required in CI: ${reason}`);
      t.skip(reason);
      return;
    }
    const chart = join(mkdtempSync(join(tmpdir(), 'clade-example-')), 'chart.png');
    const out = await run('data-analysis.mjs', [chart]);
    assert.equal(out.code, 0, `${out.stdout}\n${out.stderr}`);
    assert.match(out.stdout, /saved the chart/);
    const png = readFileSync(chart);
    assert.deepEqual([...png.subarray(0, 4)], [0x89, 0x50, 0x4e, 0x47]);
  });
});
