/**
 * Functions and schedules through `client.functions` and `client.schedules`:
 * one Python function made with code and waited for, invoked with input,
 * its runs, metrics and code read back; a tar.gz deploy whose new code
 * runs; a deploy that fails (a FunctionDeployError with its log) while the
 * version before it keeps running; a schedule triggered, paused and
 * deleted. Each deploy boots a VM and snapshots it (seconds under TCG), so
 * there are three, on one function of template `base`.
 *
 * In the other workspace: deploys and runs make sandboxes of their own,
 * and the admin workspace's tests count sandboxes.
 */

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { gunzipSync } from 'node:zlib';
import { FunctionDeployError, NotFoundError, ServiceUnavailableError } from '../src/index.js';
import { client, server, SKIP, tarGz, waitFor } from './helpers.js';

const unique = (prefix: string) => `${prefix}-${Math.random().toString(16).slice(2, 10)}`;

const HANDLER = `def handler(event):
    print("hello", event["name"])
    return {"greeting": "hi " + event["name"], "doubled": event["n"] * 2}
`;

describe('functions and schedules', { skip: SKIP }, () => {
  const clade = client({ apiKey: server.otherKey });

  test('a function is deployed, invoked, redeployed from a bundle, fails a deploy and runs on a schedule', { timeout: 900_000 }, async () => {
    const name = unique('greet');
    const fn = await clade.functions.create({ name, runtime: 'python', template: 'base', code: HANDLER });
    try {
      assert.equal(fn.status, 'ready');
      assert.equal(fn.isReady, true);
      assert.equal(fn.version, 1);
      assert.equal(fn.entrypoint, 'handler.py');
      assert.equal((await clade.snapshots.get(fn.snapshotId!)).name, `${fn.id}-v1`, 'its runs restore a snapshot of the workspace');
      assert.equal((await clade.functions.get(name)).id, fn.id, 'a function is got by its name too');
      assert.ok((await clade.functions.list()).some((f) => f.id === fn.id));

      const run = await clade.functions.invoke(fn.id, { name: 'ada', n: 21 });
      assert.equal(run.status, 'success', run.stderr ?? '');
      assert.equal(run.exitCode, 0);
      assert.deepEqual(run.output, { greeting: 'hi ada', doubled: 42 });
      assert.equal(run.stdout, 'hello ada\n');
      assert.equal(run.invokedBy, 'invoke');
      assert.equal(run.functionId, fn.id);
      assert.equal(run.coldStart, true);

      const recorded = await clade.functions.recordRun(fn.id, { status: 'error', exitCode: 1, stderr: 'boom', durationMs: 7 });
      assert.equal(recorded.invokedBy, 'recorded');
      assert.deepEqual((await clade.functions.runs(fn.id, { limit: 10 })).map((r) => r.id), [recorded.id, run.id]);
      assert.deepEqual((await clade.functions.runs(fn.id, { limit: 1 })).map((r) => r.id), [recorded.id]);
      const metrics = await clade.functions.metrics(fn.id, { periodHours: 1 });
      assert.equal(metrics.period, 1);
      assert.equal(metrics.total, 2);
      assert.equal(metrics.errors, 1);
      assert.equal(metrics.errorRate, 0.5);
      assert.equal(metrics.coldStartRate, 0.5, 'the invoke restored its sandbox, the recorded run did not');
      assert.ok(metrics.p99Ms >= metrics.p50Ms && metrics.p50Ms > 0, JSON.stringify(metrics));

      const code = gunzipSync(await clade.functions.code(fn.id)).toString('latin1');
      assert.ok(code.includes('handler.py') && code.includes(HANDLER), 'the code is a tar.gz holding the handler at its entrypoint');

      // Env applies to the next run as it is; new code comes as a bundle.
      assert.deepEqual((await clade.functions.update(fn.id, { env: { GREETING: 'hello' } })).env, { GREETING: 'hello' });
      const bundle = tarGz({
        'handler.py': 'import os\nfrom lib.shout import shout\n\ndef handler(event):\n    return {"version": 2, "said": shout(os.environ["GREETING"])}\n',
        'lib/__init__.py': '',
        'lib/shout.py': 'def shout(text):\n    return text.upper() + "!"\n',
      });
      const deployed = await clade.functions.deploy(fn.id, bundle);
      assert.equal(deployed.status, 'ready');
      assert.equal(deployed.version, 2);
      assert.deepEqual((await clade.functions.invoke(fn.id)).output, { version: 2, said: 'HELLO!' });

      // A deploy whose install fails: its log says why, and version 2 still runs.
      const broken = tarGz({ 'handler.py': 'def handler(event):\n    return 3\n', 'requirements.txt': './missing-1.0-py3-none-any.whl\n' });
      const failure = await clade.functions.deploy(fn.id, broken).then(
        () => assert.fail('a deploy of a missing wheel succeeded'),
        (e: unknown) => e,
      );
      assert.ok(failure instanceof FunctionDeployError, String(failure));
      assert.match(failure.deployLog, /missing-1\.0-py3-none-any\.whl/);
      assert.equal(failure.function.status, 'failed');
      assert.equal(failure.function.version, 3);
      assert.ok(failure.function.error, 'a failed deploy says why');

      const schedule = await clade.schedules.create({ name: unique('nightly'), functionId: fn.id, cron: '0 3 * * *', input: { from: 'schedule' } });
      try {
        assert.equal(schedule.functionId, fn.id);
        assert.equal(schedule.timezone, 'UTC');
        assert.equal(schedule.paused, false);
        assert.deepEqual(schedule.input, { from: 'schedule' });
        const next = new Date(schedule.nextRunAt ?? '');
        assert.deepEqual([next.getUTCHours(), next.getUTCMinutes()], [3, 0], `next run ${schedule.nextRunAt}`);
        assert.ok((await clade.schedules.list()).some((s) => s.id === schedule.id));

        const fired = await clade.schedules.trigger(schedule.id);
        assert.equal(fired.scheduleId, schedule.id);
        assert.equal(fired.invokedBy, 'schedule');
        assert.deepEqual(fired.output, { version: 2, said: 'HELLO!' }, 'the version before the failed deploy runs');
        assert.deepEqual((await clade.schedules.runs(schedule.id)).map((r) => r.id), [fired.id]);

        const paused = await clade.schedules.pause(schedule.id);
        assert.equal(paused.paused, true);
        assert.equal(paused.nextRunAt ?? undefined, undefined, 'a paused schedule has no next run');
        assert.ok((await clade.schedules.resume(schedule.id)).nextRunAt);
      } finally {
        await clade.schedules.delete(schedule.id);
      }
      await assert.rejects(clade.schedules.get(schedule.id), NotFoundError);
    } finally {
      await clade.functions.delete(fn.id);
    }
    await assert.rejects(clade.functions.get(fn.id), NotFoundError);
    // Runs delete their sandboxes once they have answered; the suite counts what is left.
    await waitFor('the runs’ sandboxes to go', async () => !(await clade.sandboxes.list()).some((s) => s.metadata['clade.function'] === fn.id), 60_000);
  });

  test('an unknown function is a NotFoundError, one without code a ServiceUnavailableError', async () => {
    await assert.rejects(clade.functions.get('fn-0000000000000000'), NotFoundError);
    await assert.rejects(clade.functions.invoke('no-such-function', {}), NotFoundError);
    const empty = await clade.functions.create({ name: unique('empty'), runtime: 'nodejs' });
    try {
      assert.equal(empty.status, 'empty');
      assert.equal(empty.entrypoint, 'handler.js');
      await assert.rejects(clade.functions.invoke(empty.id), (e: unknown) => e instanceof ServiceUnavailableError && /deploy code first/.test(e.message));
    } finally {
      await clade.functions.delete(empty.id);
    }
  });
});
