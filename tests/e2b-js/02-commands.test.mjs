// Commands through envd's process service (Connect over HTTP), in one
// sandbox of this file: a blocking run's output and exit code, output
// streamed to callbacks, a non-zero exit, the command timeout, background
// commands (their pid, list, connect, kill), stdin, and a command's user,
// working directory and environment.

import assert from 'node:assert/strict'
import { randomUUID } from 'node:crypto'
import { after, before, describe, it } from 'node:test'

import { CommandExitError, SandboxNotFoundError, TimeoutError } from 'e2b'

import { COMMAND_TIMEOUT_MS, TEST_TIMEOUT_MS, killQuietly, newSandbox, notHere, sleep, waitFor } from './helpers.mjs'

describe('commands', { skip: notHere }, () => {
  let sandbox
  const run = (cmd, opts = {}) => sandbox.commands.run(cmd, { timeoutMs: COMMAND_TIMEOUT_MS, ...opts })
  const runningPids = async () => (await sandbox.commands.list()).map((p) => p.pid)

  before(async () => {
    sandbox = await newSandbox({ metadata: { purpose: 'commands' } })
  }, { timeout: TEST_TIMEOUT_MS })

  after(async () => {
    await killQuietly(sandbox)
  }, { timeout: TEST_TIMEOUT_MS })

  it('runs to its end with its output and exit code', { timeout: TEST_TIMEOUT_MS }, async () => {
    const result = await run('echo hello; echo oops >&2')
    assert.deepEqual(
      { stdout: result.stdout, stderr: result.stderr, exitCode: result.exitCode },
      { stdout: 'hello\n', stderr: 'oops\n', exitCode: 0 },
    )
    assert.ok(!result.error, result.error)
  })

  it('streams its output to callbacks as it comes', { timeout: TEST_TIMEOUT_MS }, async () => {
    const stdout = []
    const stderr = []
    const result = await run('for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.2; done', {
      onStdout: (data) => stdout.push(data),
      onStderr: (data) => stderr.push(data),
    })
    assert.equal(stdout.join(''), 'out1\nout2\nout3\n')
    assert.equal(stderr.join(''), 'err1\nerr2\nerr3\n')
    assert.equal(result.stdout, 'out1\nout2\nout3\n')
    assert.equal(result.stderr, 'err1\nerr2\nerr3\n')
    assert.ok(stdout.length >= 2, `several chunks, not one at the end: ${JSON.stringify(stdout)}`)
  })

  it('rejects with a CommandExitError on a non-zero exit', { timeout: TEST_TIMEOUT_MS }, async () => {
    await assert.rejects(run('echo partial; echo bad >&2; exit 3'), (err) => {
      assert.ok(err instanceof CommandExitError, err)
      assert.equal(err.exitCode, 3)
      assert.equal(err.stdout, 'partial\n')
      assert.equal(err.stderr, 'bad\n')
      return true
    })
  })

  it('rejects with a TimeoutError past its timeout', { timeout: TEST_TIMEOUT_MS }, async () => {
    const started = Date.now()
    await assert.rejects(run('sleep 30', { timeoutMs: 2_000 }), (err) => {
      // The deadline, not a sandbox that went away.
      assert.ok(err instanceof TimeoutError && !(err instanceof SandboxNotFoundError), err)
      return true
    })
    assert.ok(Date.now() - started < 25_000, 'the wait outlasted its 2 s timeout')
    assert.equal((await run('echo after')).stdout, 'after\n')
  })

  it('runs in the background: listed, connected to and killed', { timeout: TEST_TIMEOUT_MS }, async () => {
    const handle = await run('sleep 600', { background: true })
    let again
    try {
      assert.ok(Number.isInteger(handle.pid) && handle.pid > 0, String(handle.pid))
      assert.equal(handle.exitCode, undefined)
      const listed = await sandbox.commands.list()
      const mine = listed.find((p) => p.pid === handle.pid)
      assert.ok(mine, JSON.stringify(listed))
      assert.ok([mine.cmd, ...mine.args].join(' ').includes('sleep 600'), JSON.stringify(mine))

      // A second stream of the same command.
      again = await sandbox.commands.connect(handle.pid, { timeoutMs: COMMAND_TIMEOUT_MS })
      assert.equal(again.pid, handle.pid)

      assert.equal(await sandbox.commands.kill(handle.pid), true)
      await waitFor(async () => !(await runningPids()).includes(handle.pid),
        { timeoutMs: 30_000, what: 'the killed command gone from the list' })
      // Both streams end with the kill: a non-zero exit.
      for (const stream of [handle, again]) {
        await assert.rejects(stream.wait(), CommandExitError)
      }
      assert.equal(await sandbox.commands.kill(handle.pid), false)
    } finally {
      await handle.kill().catch(() => {})
      await handle.disconnect().catch(() => {})
      await again?.disconnect().catch(() => {})
    }
  })

  it('outlives the stream that started it, and is reconnected to', { timeout: TEST_TIMEOUT_MS }, async () => {
    const tag = randomUUID().slice(0, 8)
    const handle = await run(
      `echo started-${tag}; while [ ! -e /tmp/go-${tag} ]; do sleep 0.2; done; echo late-${tag}; exit 7`,
      { background: true, timeoutMs: 0 },
    )
    const pid = handle.pid
    await handle.disconnect()
    // Still running with nobody listening.
    await sleep(2_000)
    assert.ok((await runningPids()).includes(pid))

    const stdout = []
    const again = await sandbox.commands.connect(pid, { timeoutMs: COMMAND_TIMEOUT_MS, onStdout: (d) => stdout.push(d) })
    await run(`touch /tmp/go-${tag}`)
    await assert.rejects(again.wait(), (err) => {
      assert.ok(err instanceof CommandExitError, err)
      assert.equal(err.exitCode, 7)
      assert.ok(err.stdout.includes(`late-${tag}\n`), err.stdout)
      return true
    })
    assert.ok(stdout.join('').includes(`late-${tag}\n`), stdout.join(''))
    await waitFor(async () => !(await runningPids()).includes(pid),
      { timeoutMs: 30_000, what: 'the finished command gone from the list' })
  })

  it('takes stdin when started with it', { timeout: TEST_TIMEOUT_MS }, async () => {
    const handle = await run('cat', { background: true, stdin: true })
    try {
      await sandbox.commands.sendStdin(handle.pid, 'ping\n')
      await handle.sendStdin(new TextEncoder().encode('pong\n'))
      await sandbox.commands.closeStdin(handle.pid)
      const result = await handle.wait()
      assert.deepEqual({ stdout: result.stdout, exitCode: result.exitCode }, { stdout: 'ping\npong\n', exitCode: 0 })
    } finally {
      await handle.kill().catch(() => {})
    }
  })

  it('runs as the user, in its home, with its environment, unless told otherwise', { timeout: TEST_TIMEOUT_MS }, async () => {
    const out = async (cmd, opts) => (await run(cmd, opts)).stdout
    assert.equal(await out('whoami'), 'user\n')
    assert.equal(await out('pwd'), '/home/user\n')
    assert.equal(await out('whoami', { user: 'root' }), 'root\n')
    assert.equal(await out('pwd', { cwd: '/tmp' }), '/tmp\n')
    assert.equal(await out('echo $BAR', { envs: { BAR: 'baz' } }), 'baz\n')
    // A command's environment is its own.
    assert.equal(await out('echo ${BAR:-unset}'), 'unset\n')
  })
})
