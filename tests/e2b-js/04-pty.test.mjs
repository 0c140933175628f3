// A PTY through envd's process service, in one sandbox of this file: an
// interactive login shell of the given size that echoes what is typed,
// runs it, follows a resize, and ends when killed; and one that exits with
// its code.

import assert from 'node:assert/strict'
import { after, before, describe, it } from 'node:test'

import { CommandExitError } from 'e2b'

import {
  TEST_TIMEOUT_MS, killQuietly, newSandbox, notHere, settledWithin, sleep, waitFor,
} from './helpers.mjs'

// Milliseconds to wait for what was typed to show: a login shell under TCG is slow to start.
const SHOW_TIMEOUT_MS = 90_000
// The PTY's own limit (the SDK's default is 60 s).
const PTY_TIMEOUT_MS = 300_000

// What a PTY printed so far, and waiting for something in it.
class PtyOutput {
  constructor() {
    this.data = Buffer.alloc(0)
    this.onData = (chunk) => {
      this.data = Buffer.concat([this.data, Buffer.from(chunk)])
    }
  }

  // Waits until `needle` shows past offset `after`; returns where it ends.
  async waitFor(needle, after = 0) {
    let at = -1
    await waitFor(() => (at = this.data.indexOf(needle, after)) >= 0, {
      timeoutMs: SHOW_TIMEOUT_MS,
      intervalMs: 100,
      what: () => `${JSON.stringify(needle)} in the PTY's output: ${JSON.stringify(this.tail())}`,
    })
    return at + Buffer.byteLength(needle)
  }

  tail() {
    return this.data.subarray(-2000).toString('utf8')
  }
}

const typed = (text) => new TextEncoder().encode(text)

describe('a PTY', { skip: notHere }, () => {
  let sandbox

  before(async () => {
    sandbox = await newSandbox({ metadata: { purpose: 'pty' } })
  }, { timeout: TEST_TIMEOUT_MS })

  after(async () => {
    await killQuietly(sandbox)
  }, { timeout: TEST_TIMEOUT_MS })

  it('runs a shell that echoes, follows a resize and ends when killed', { timeout: TEST_TIMEOUT_MS }, async () => {
    const output = new PtyOutput()
    const handle = await sandbox.pty.create({ cols: 80, rows: 24, onData: output.onData, timeoutMs: PTY_TIMEOUT_MS })
    const ended = handle.wait()
    ended.catch(() => {}) // looked at below; not an unhandled rejection if a step before fails
    let killed = false
    try {
      assert.ok(handle.pid > 0, String(handle.pid))
      assert.ok((await sandbox.commands.list()).some((p) => p.pid === handle.pid), 'the PTY among the processes')

      // The typed line echoes back as typed, and its output shows after it.
      await sandbox.pty.sendInput(handle.pid, typed('echo hi\n'))
      let at = await output.waitFor('echo hi')
      at = await output.waitFor('hi\r\n', at)

      await sandbox.pty.sendInput(handle.pid, typed('stty size; echo who-$(whoami) term-$TERM\n'))
      at = await output.waitFor('24 80', at)
      at = await output.waitFor('who-user term-xterm', at)

      await sandbox.pty.resize(handle.pid, { cols: 120, rows: 30 })
      await sandbox.pty.sendInput(handle.pid, typed('stty size\n'))
      at = await output.waitFor('30 120', at)

      // Ctrl-C reaches the shell's foreground job through the terminal.
      await sandbox.pty.sendInput(handle.pid, typed('sleep 600\n'))
      await sleep(1_000)
      await sandbox.pty.sendInput(handle.pid, typed('\x03'))
      // Apart: the terminal drops what was typed ahead of an interrupt.
      await sleep(1_000)
      await sandbox.pty.sendInput(handle.pid, typed('echo interrupted-$((1 + 1))\n'))
      await output.waitFor('interrupted-2', at)

      assert.equal(await sandbox.pty.kill(handle.pid), true)
      killed = true
      const error = await settledWithin(ended, 60_000, 'still running')
      assert.ok(error instanceof CommandExitError, `the PTY's stream ended with ${error}`)
      assert.equal(await sandbox.pty.kill(handle.pid), false)
    } finally {
      if (!killed) await sandbox.pty.kill(handle.pid).catch(() => {})
      await handle.disconnect().catch(() => {})
    }
  })

  it('ends its stream with the exit code of its shell', { timeout: TEST_TIMEOUT_MS }, async () => {
    const output = new PtyOutput()
    const handle = await sandbox.pty.create({
      cols: 80, rows: 24, onData: output.onData, timeoutMs: PTY_TIMEOUT_MS, user: 'root', cwd: '/tmp',
    })
    const ended = handle.wait()
    ended.catch(() => {}) // looked at below; not an unhandled rejection if a step before fails
    try {
      await sandbox.pty.sendInput(handle.pid, typed('echo who-$(whoami)-in-$(pwd)\n'))
      await output.waitFor('who-root-in-/tmp')
      await sandbox.pty.sendInput(handle.pid, typed('exit 5\n'))
      const error = await settledWithin(ended, SHOW_TIMEOUT_MS, 'still running')
      assert.ok(error instanceof CommandExitError, `the PTY's stream ended with ${error}: ${output.tail()}`)
      assert.equal(error.exitCode, 5)
    } finally {
      await sandbox.pty.kill(handle.pid).catch(() => {})
      await handle.disconnect().catch(() => {})
    }
  })
})
