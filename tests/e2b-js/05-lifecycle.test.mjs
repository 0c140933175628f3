// A sandbox's life through E2B's control plane: a pause keeps its files and
// its running processes until a connect resumes it.

import assert from 'node:assert/strict'
import { after, before, describe, it } from 'node:test'

import { Sandbox } from 'e2b'

import {
  COMMAND_TIMEOUT_MS, REQUEST_TIMEOUT_MS, RUN, SANDBOX_TIMEOUT_MS, TEST_TIMEOUT_MS, killQuietly, listedIds,
  newSandbox, notHere,
} from './helpers.mjs'

const opts = { requestTimeoutMs: REQUEST_TIMEOUT_MS }
// This run's sandboxes in the given states.
const inState = (...state) => listedIds({ query: { metadata: { run: RUN }, state } })

describe('a paused sandbox', { skip: notHere }, () => {
  let sandbox

  before(async () => {
    sandbox = await newSandbox({ metadata: { purpose: 'pause' } })
  }, { timeout: TEST_TIMEOUT_MS })

  after(async () => {
    await killQuietly(sandbox)
  }, { timeout: TEST_TIMEOUT_MS })

  it('resumes on connect with its files and processes', { timeout: TEST_TIMEOUT_MS }, async () => {
    const run = (target, cmd) => target.commands.run(cmd, { timeoutMs: COMMAND_TIMEOUT_MS })
    await sandbox.files.write('/home/user/kept.txt', 'before the pause')
    // A process of its own session, so that it is nobody's stream: only the
    // sandbox's memory keeps it (a cold boot would not have it).
    const started = await run(sandbox, 'setsid sleep 3600 </dev/null >/dev/null 2>&1 & echo $!')
    const pid = Number.parseInt(started.stdout.trim(), 10)
    assert.equal((await run(sandbox, `kill -0 ${pid}`)).exitCode, 0)
    // And one started through envd, waiting for its input, whose stream stays open.
    const waiting = await sandbox.commands.run('echo started; read line; echo "got $line"; exit 7',
      { background: true, stdin: true, timeoutMs: 0 })

    assert.equal(await sandbox.pause(opts), true)
    assert.equal((await Sandbox.getInfo(sandbox.sandboxId, opts)).state, 'paused')
    assert.ok((await inState('paused')).includes(sandbox.sandboxId))
    assert.ok(!(await inState('running')).includes(sandbox.sandboxId))
    // Pausing what is paused already says so.
    assert.equal(await sandbox.pause(opts), false)

    const resumed = await Sandbox.connect(sandbox.sandboxId, { timeoutMs: SANDBOX_TIMEOUT_MS, ...opts })
    assert.equal(resumed.sandboxId, sandbox.sandboxId)
    assert.equal((await Sandbox.getInfo(sandbox.sandboxId, opts)).state, 'running')
    assert.equal(await resumed.files.read('/home/user/kept.txt'), 'before the pause')
    const cmdline = (await run(resumed, `tr '\\0' ' ' < /proc/${pid}/cmdline`)).stdout
    assert.equal(cmdline.trim(), 'sleep 3600')
    // The envd process is listed again after the pause, takes input, and the
    // stream opened before the pause sees it to its end.
    const listed = (await resumed.commands.list(opts)).map((p) => p.pid)
    assert.ok(listed.includes(waiting.pid), `${waiting.pid} in ${listed}`)
    await resumed.commands.sendStdin(waiting.pid, 'hello\n', opts)
    await assert.rejects(waiting.wait(), (error) => {
      assert.equal(error.exitCode, 7)
      assert.equal(error.stdout, 'started\ngot hello\n')
      return true
    })
    // The handle made before the pause works again too.
    assert.equal((await run(sandbox, 'echo awake')).stdout, 'awake\n')
  })
})
