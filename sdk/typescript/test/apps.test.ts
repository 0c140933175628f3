/**
 * Apps through `client.apps`: one app made from a git repository of this
 * test's own (`file://`: run.ts starts the server with
 * --apps-allow-file-urls), holding a stdlib Python web server (detected as
 * `python`, nothing to install). Its variables and a masked secret, one
 * deployment followed through its log stream to the end, the app answering
 * at its host name `{name}.localhost` through the server, its runtime log,
 * a rollback refused (nothing earlier), bad input refused, the delete.
 * Each deployment boots a VM (seconds under TCG), so there is one.
 *
 * In the other workspace: the deployment makes a sandbox of its own, and
 * the admin workspace's tests count sandboxes.
 */

import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { request as httpRequest } from 'node:http';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, test } from 'node:test';
import { BadRequestError, ConflictError, NotFoundError } from '../src/index.js';
import { client, server, SKIP, waitFor } from './helpers.js';

const RUN = Math.random().toString(16).slice(2, 8);

const SERVER_PY = `import json
import os
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({
            "version": 1,
            "path": self.path,
            "greeting": os.environ.get("GREETING"),
            "secret": os.environ.get("API_SECRET"),
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


if __name__ == "__main__":
    port = int(os.environ["PORT"])
    print(f"serving version 1 on {port}", flush=True)
    ThreadingHTTPServer(("0.0.0.0", port), Handler).serve_forever()
`;

/** A git repository in a temporary directory, on branch main, with `files` committed. */
function gitRepo(files: Record<string, string>): string {
  const dir = mkdtempSync(join(tmpdir(), 'clade-sdk-ts-app-'));
  const env = { PATH: process.env['PATH'] ?? '/usr/bin:/bin', HOME: dir, GIT_AUTHOR_NAME: 't', GIT_AUTHOR_EMAIL: 't@t', GIT_COMMITTER_NAME: 't', GIT_COMMITTER_EMAIL: 't@t' };
  const git = (...args: string[]) => {
    const run = spawnSync('git', ['-C', dir, ...args], { env, encoding: 'utf8' });
    if (run.status !== 0) throw new Error(`git ${args.join(' ')}: ${run.stderr}`);
  };
  git('init', '-q', '-b', 'main');
  for (const [name, content] of Object.entries(files)) writeFileSync(join(dir, name), content);
  git('add', '-A');
  git('commit', '-q', '-m', 'version 1');
  return dir;
}

/**
 * A GET to the app's host name through the server. Not with fetch: it
 * will not send a Host header of the caller's.
 */
function appGet(name: string, path = '/'): Promise<{ status: number; body: string }> {
  const url = new URL(server.url);
  return new Promise((resolve, reject) => {
    const req = httpRequest(
      { hostname: url.hostname, port: url.port, path, method: 'GET', headers: { host: `${name}.localhost:${url.port}` }, timeout: 120_000 },
      (res) => {
        const chunks: Buffer[] = [];
        res.on('data', (chunk: Buffer) => chunks.push(chunk));
        res.on('end', () => resolve({ status: res.statusCode ?? 0, body: Buffer.concat(chunks).toString('utf8') }));
        res.on('error', reject);
      },
    );
    req.on('timeout', () => req.destroy(new Error(`no answer from ${name}.localhost in 120 s`)));
    req.on('error', reject);
    req.end();
  });
}

describe('apps', { skip: SKIP }, () => {
  const clade = client({ apiKey: server.otherKey });

  test('an app deploys from git, answers at its host name with its variables, and is deleted', { timeout: 900_000 }, async () => {
    const repo = gitRepo({ 'README.md': 'an app\n', 'server.py': SERVER_PY });
    const name = `shop-${RUN}`;
    const port = new URL(server.url).port;
    const app = await clade.apps.create({ name, gitUrl: `file://${repo}`, port: 8080, env: { GREETING: 'hello' } });
    let deleted = false;
    try {
      assert.equal(app.status, 'created');
      assert.equal(app.port, 8080);
      assert.equal(app.gitBranch, 'main');
      assert.equal(app.url ?? undefined, undefined, 'no url before a deployment is live');
      assert.deepEqual(app.env, { GREETING: 'hello' });
      assert.equal(app.keepDeployments, 3);
      assert.equal((await clade.apps.get(name)).id, app.id, 'an app is got by its name too');
      assert.ok((await clade.apps.list()).some((a) => a.id === app.id));
      assert.deepEqual(await clade.apps.deployments(app.id), []);

      // Variables: a secret is masked in every answer; an import adds; an unset removes.
      assert.deepEqual(await clade.apps.setEnv(app.id, 'API_SECRET', 's3cret', { secret: true }), { key: 'API_SECRET', secret: true, scope: 'all' });
      const env = Object.fromEntries((await clade.apps.env(app.id)).map((v) => [v.key, v]));
      assert.equal(env['API_SECRET']?.value, '••••••••');
      assert.equal(env['API_SECRET']?.secret, true);
      assert.equal(env['GREETING']?.value, 'hello');
      assert.ok(env['GREETING']?.updatedAt, 'a variable says when it was set');
      const got = await clade.apps.get(app.id);
      assert.equal(got.env['API_SECRET'], '••••••••');
      assert.ok(!JSON.stringify(got).includes('s3cret'), 'the secret is in no answer');
      assert.deepEqual(await clade.apps.importEnv(app.id, '# settings\nexport MODE="prod"\n'), { imported: 1, total: 3 });
      await clade.apps.unsetEnv(app.id, 'MODE');
      assert.deepEqual((await clade.apps.env(app.id)).map((v) => v.key).sort(), ['API_SECRET', 'GREETING']);
      await assert.rejects(clade.apps.unsetEnv(app.id, 'MODE'), NotFoundError);
      const updated = await clade.apps.update(app.id, { keepDeployments: 2 });
      assert.equal(updated.keepDeployments, 2);
      assert.equal(updated.port, 8080, 'an update leaves the fields it does not give');

      // One deployment, followed through its log stream to its end.
      const started = Date.now();
      const deployment = await clade.apps.deploy(app.id);
      assert.equal(deployment.status, 'queued');
      assert.equal(deployment.appId, app.id);
      assert.equal(deployment.gitRef, 'main');
      const lines: string[] = [];
      for await (const line of clade.apps.deployLogs(app.id, deployment.id)) lines.push(line);
      const done = await clade.apps.deployment(app.id, deployment.id);
      const took = Date.now() - started;
      assert.equal(done.status, 'live', `${done.error ?? ''}\n${done.buildLogs ?? ''}`);
      const kept = (done.buildLogs ?? '').split('\n');
      if (kept.at(-1) === '') kept.pop();
      assert.deepEqual(lines.map((l) => l.trim()), kept.map((l) => l.trim()), 'the stream had the log the deployment kept, line by line, and ended with it');
      assert.ok(lines.some((l) => l.includes('framework: python (detected)')), lines.slice(-10).join('\n'));
      assert.ok(lines.some((l) => l.includes('serving version 1 on 8080')), lines.slice(-10).join('\n'));
      assert.equal(done.framework, 'python');
      assert.equal(done.gitCommit?.length, 40);
      assert.ok(done.sandboxId, 'a live deployment has its sandbox');
      assert.ok(done.finishedAt);
      console.error(`app deployment live in ${(took / 1000).toFixed(1)} s`);

      const live = await clade.apps.get(app.id);
      assert.equal(live.status, 'live');
      assert.equal(live.activeDeploymentId, done.id);
      assert.equal(live.sandboxId, done.sandboxId);
      assert.equal(live.url, `http://${name}.localhost:${port}`);
      assert.deepEqual((await clade.apps.deployments(app.id)).map((d) => [d.id, d.status, d.buildLogs]), [[done.id, 'live', undefined]]);

      const answer = await appGet(name, '/items?x=1');
      assert.equal(answer.status, 200, answer.body);
      assert.deepEqual(JSON.parse(answer.body), { version: 1, path: '/items?x=1', greeting: 'hello', secret: 's3cret' });
      assert.match(await clade.apps.runtimeLogs(app.id, { limit: 4096 }), /serving version 1 on 8080/);

      await assert.rejects(clade.apps.rollback(app.id), (e: unknown) => e instanceof ConflictError && /cannot roll back/.test(e.message));
      assert.equal((await clade.apps.get(app.id)).activeDeploymentId, done.id, 'a refused rollback changes nothing');

      await clade.apps.delete(app.id);
      deleted = true;
      await assert.rejects(clade.apps.get(app.id), NotFoundError);
      assert.equal((await appGet(name)).status, 404, 'a deleted app’s host name no longer answers');
      // Each host sweeps a deleted app's sandboxes (every 10 s); the suite counts what is left.
      await waitFor('the deployment’s sandbox to go', async () => !(await clade.sandboxes.list()).some((s) => s.id === done.sandboxId), 60_000, 1000);
    } finally {
      if (!deleted) await clade.apps.delete(app.id).catch(() => undefined);
      rmSync(repo, { recursive: true, force: true });
    }
  });

  test('bad input is refused with the reason', async () => {
    const url = 'https://example.test/x.git';
    await assert.rejects(clade.apps.create({ name: 'Bad_Name', gitUrl: url }), (e: unknown) => e instanceof BadRequestError && /invalid app name/.test(e.message));
    await assert.rejects(clade.apps.create({ name: 'api', gitUrl: url }), (e: unknown) => e instanceof BadRequestError && /reserved/.test(e.message));
    await assert.rejects(clade.apps.get('app-nosuchthing'), NotFoundError);

    const app = await clade.apps.create({ name: `taken-${RUN}`, gitUrl: url });
    try {
      // Names are host names: unique on the server, whatever the workspace.
      await assert.rejects(client().apps.create({ name: `taken-${RUN}`, gitUrl: url }), (e: unknown) => e instanceof ConflictError && /taken/.test(e.message));
      await assert.rejects(client().apps.get(app.id), NotFoundError, 'another workspace’s app is not found');
      await assert.rejects(clade.apps.deploy(app.id, { gitRef: '--upload-pack=touch /tmp/x' }), BadRequestError);
      await assert.rejects(clade.apps.setEnv(app.id, '1BAD', 'x'), BadRequestError);
      await assert.rejects(clade.apps.rollback(app.id), ConflictError, 'nothing is live');
      await assert.rejects(
        (async () => {
          for await (const line of clade.apps.deployLogs(app.id, 'dep-nosuchthing')) assert.fail(`a line of no deployment: ${line}`);
        })(),
        NotFoundError,
      );
    } finally {
      await clade.apps.delete(app.id);
    }
  });
});
