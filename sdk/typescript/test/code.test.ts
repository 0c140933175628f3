/** Code contexts in the code-interpreter template: state across cells, rich results (a matplotlib PNG), streaming. */

import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { AbortError, type CodeEvent, type Sandbox } from '../src/index.js';
import { client, inCi, SKIP, waitFor } from './helpers.js';

const PNG_MAGIC = [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a];

async function codeInterpreterMissing(): Promise<string | undefined> {
  if (SKIP) return SKIP;
  const templates = await client().templates.list();
  if (templates.some((t) => t.name === 'code-interpreter' && t.ready)) return undefined;
  const reason = 'the code-interpreter template is not built (clade images build --image code-interpreter)';
  if (inCi()) throw new Error(`required in CI: ${reason}`);
  return reason;
}

const missing = await codeInterpreterMissing();

describe('code contexts', { skip: missing }, () => {
  const clade = client();
  let sb: Sandbox;
  before(async () => {
    sb = await clade.sandboxes.create({ template: 'code-interpreter' });
  });
  after(async () => {
    await sb?.delete().catch(() => undefined);
  });

  test('a matplotlib chart comes back as PNG bytes; variables live from cell to cell', async () => {
    const first = await sb.runCode('x = 41\nprint("set")', { timeoutMs: 120_000 });
    assert.equal(first.stdout, 'set\n');
    assert.equal(first.exitCode, 0);
    const second = await sb.runCode('x + 1', { timeoutMs: 120_000 });
    assert.equal(second.results[0]?.text, '42');
    const chart = await sb.runCode('import matplotlib.pyplot as plt\nplt.plot([1, 3, 2])\nplt.title("t")\nplt.show()', { timeoutMs: 120_000 });
    const png = chart.results.find((r) => r.png)?.png;
    assert.ok(png, JSON.stringify(chart.results.map((r) => r.formats)));
    assert.deepEqual([...png.subarray(0, 8)], PNG_MAGIC);
    assert.ok(png.length > 1000);
  });

  test('an exception is the cell\'s error; a streamed cell yields output, results and the execution last', async () => {
    const failed = await sb.runCode('1/0');
    assert.equal(failed.exitCode, 1);
    assert.match(failed.error ?? '', /ZeroDivisionError/);
    const events: CodeEvent[] = [];
    for await (const event of sb.runCodeStream('import time\nfor i in range(3):\n    print(i, flush=True)\n    time.sleep(0.2)\n{"a": 1}')) {
      events.push(event);
    }
    const types = events.map((e) => e.type);
    assert.equal(types.at(-1), 'execution');
    assert.ok(types.indexOf('stdout') < types.indexOf('result'), types.join());
    const last = events.at(-1);
    assert.ok(last?.type === 'execution');
    assert.equal(last.execution.stdout, '0\n1\n2\n');
  });

  test('aborting a python cell interrupts it: the next cell runs at once, and the state is kept', async () => {
    await sb.runCode('kept = "still here"', { timeoutMs: 120_000 });
    const controller = new AbortController();
    const started = Date.now();
    const cell = sb.runCode('import time\ntime.sleep(600)', { timeoutMs: 900_000, signal: controller.signal });
    setTimeout(() => controller.abort(), 1000);
    await assert.rejects(cell, AbortError);
    assert.ok(Date.now() - started < 30_000);
    const next = Date.now();
    const after = await sb.runCode('kept', { timeoutMs: 60_000 });
    assert.equal(after.results[0]?.text, "'still here'");
    assert.ok(Date.now() - next < 20_000, `the next cell waited ${Date.now() - next} ms: the aborted one still ran`);
  });

  test('leaving a streamed bash cell early stops its command; the shell keeps its variables', async () => {
    const bash = await sb.codeContexts.create({ language: 'bash' });
    await bash.run('KEPT=yes');
    for await (const event of bash.runStream('echo started; sleep 600')) {
      assert.equal(event.type, 'stdout');
      break;
    }
    await waitFor('sleep 600 to be gone', async () => (await sb.exec('pgrep -f "sleep 60[0]" || true')).stdout.trim() === '', 15_000);
    assert.equal((await bash.run('echo $KEPT', { timeoutMs: 60_000 })).stdout.trim(), 'yes');
    await bash.delete();
  });

  test('contexts are created (python, bash), listed and deleted', async () => {
    const bash = await sb.codeContexts.create({ language: 'bash', cwd: '/tmp' });
    assert.equal(bash.language, 'bash');
    const out = await bash.run('pwd; X=5');
    assert.equal(out.stdout.trim(), '/tmp');
    assert.equal((await bash.run('echo $X')).stdout.trim(), '5');
    const listed = await sb.codeContexts.list();
    assert.ok(listed.some((c) => c.id === bash.id && c.alive !== false));
    await bash.delete();
    assert.ok(!(await sb.codeContexts.list()).some((c) => c.id === bash.id));
  });
});
