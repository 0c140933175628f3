/** Settings: options, then CLADE_API_URL / CLADE_API_KEY, then the config file; the URL with or without /v1. */

import assert from 'node:assert/strict';
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, describe, test } from 'node:test';
import { Clade, CladeError } from '../src/index.js';

const saved = { ...process.env };
afterEach(() => {
  for (const name of ['CLADE_API_URL', 'CLADE_API_KEY', 'CLADE_CONFIG', 'XDG_CONFIG_HOME']) {
    if (saved[name] === undefined) delete process.env[name];
    else process.env[name] = saved[name];
  }
});

function configFile(content: unknown): string {
  const path = join(mkdtempSync(join(tmpdir(), 'clade-config-')), 'config.json');
  writeFileSync(path, JSON.stringify(content));
  return path;
}

describe('settings', () => {
  test('options win over the environment, which wins over the config file', async () => {
    process.env['CLADE_CONFIG'] = configFile({ api_url: 'http://file:1', api_key: 'from-file' });
    process.env['CLADE_API_URL'] = 'http://env:2/v1/';
    process.env['CLADE_API_KEY'] = 'from-env';
    assert.deepEqual(await new Clade({ baseUrl: 'http://opt:3', apiKey: 'from-opt' }).resolvedSettings(), { baseUrl: 'http://opt:3', apiKey: 'from-opt' });
    assert.deepEqual(await new Clade().resolvedSettings(), { baseUrl: 'http://env:2', apiKey: 'from-env' });
    delete process.env['CLADE_API_URL'];
    delete process.env['CLADE_API_KEY'];
    assert.deepEqual(await new Clade().resolvedSettings(), { baseUrl: 'http://file:1', apiKey: 'from-file' });
  });

  test('the config file may name the key `token`, as the CLI reads it; XDG_CONFIG_HOME is where it lives', async () => {
    delete process.env['CLADE_API_URL'];
    delete process.env['CLADE_API_KEY'];
    delete process.env['CLADE_CONFIG'];
    const home = mkdtempSync(join(tmpdir(), 'clade-xdg-'));
    const path = join(home, 'clade', 'config.json');
    (await import('node:fs')).mkdirSync(join(home, 'clade'));
    writeFileSync(path, JSON.stringify({ token: 'tok' }));
    process.env['XDG_CONFIG_HOME'] = home;
    assert.deepEqual(await new Clade().resolvedSettings(), { baseUrl: 'http://127.0.0.1:8080', apiKey: 'tok' });
  });

  test('a call without any key says where to put one', async () => {
    delete process.env['CLADE_API_KEY'];
    process.env['CLADE_CONFIG'] = join(tmpdir(), 'no-such-clade-config.json');
    await assert.rejects(new Clade({ baseUrl: 'http://127.0.0.1:9' }).me(), (e: unknown) => e instanceof CladeError && /CLADE_API_KEY/.test(e.message));
  });
});
