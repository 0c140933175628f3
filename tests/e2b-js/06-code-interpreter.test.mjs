// The code interpreter (`@e2b/code-interpreter`'s `Sandbox.runCode`, port
// 49999) on Clade's code contexts, in one `code-interpreter` sandbox: a
// cell's value and state kept for the next, a matplotlib chart as a PNG, a
// DataFrame as HTML, an exception as the execution's error, and output
// streamed to callbacks. The template is built first if it is not cached
// (under /var/cache/clade); when it cannot be, the tests skip, or fail
// when `CI` is set.

import assert from 'node:assert/strict'
import { execFile } from 'node:child_process'
import { after, before, describe, it } from 'node:test'
import { promisify } from 'node:util'

import { Sandbox as CodeSandbox } from '@e2b/code-interpreter'

import { TEST_TIMEOUT_MS, killQuietly, newSandbox, notHere, skipOrFail } from './helpers.mjs'

const CODE_TEMPLATE = 'code-interpreter'
// Milliseconds building the image may take, when it is not cached yet.
const IMAGE_BUILD_TIMEOUT_MS = 1_800_000
// Milliseconds a cell may run: the first one starts the kernel, under TCG.
const CELL_TIMEOUT_MS = 300_000
const PNG_MAGIC = Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a])

describe('the code interpreter', { skip: notHere }, () => {
  let notebook
  // Why there is no notebook, when there is none.
  let problem

  before(async () => {
    try {
      await promisify(execFile)(process.env.CLADE_BIN, ['images', 'build', '--image', CODE_TEMPLATE],
        { timeout: IMAGE_BUILD_TIMEOUT_MS, maxBuffer: 64 << 20 })
    } catch (err) {
      problem = `the ${CODE_TEMPLATE} template cannot be built:\n${String(err.stderr ?? err).slice(-2000)}`
      return
    }
    notebook = await newSandbox({ cls: CodeSandbox, template: CODE_TEMPLATE, metadata: { purpose: 'code' },
      envs: { SANDBOX_VAR: 'from create' } })
  }, { timeout: IMAGE_BUILD_TIMEOUT_MS + TEST_TIMEOUT_MS })

  after(async () => {
    await killQuietly(notebook)
  }, { timeout: TEST_TIMEOUT_MS })

  const run = (code, opts = {}) => notebook.runCode(code, { timeoutMs: CELL_TIMEOUT_MS, ...opts })

  it('gives a cell its value, and keeps the state for the next', { timeout: TEST_TIMEOUT_MS }, async (t) => {
    if (problem) return skipOrFail(t, problem)
    const first = await run('x = 2; x * 21')
    assert.equal(first.error, undefined, JSON.stringify(first.error))
    assert.equal(first.text, '42')
    assert.deepEqual(first.results.map((r) => r.isMainResult), [true])
    assert.deepEqual((await run('y = x + 1')).results, [])
    assert.equal((await run('x * y')).text, '6')
    const printed = await run("print('printed', x)")
    assert.deepEqual(printed.logs.stdout, ['printed 2\n'])
    assert.deepEqual(printed.results, [])
  })

  it("gives the kernels the sandbox's variables", { timeout: TEST_TIMEOUT_MS }, async (t) => {
    if (problem) return skipOrFail(t, problem)
    assert.equal((await run("import os; os.environ.get('SANDBOX_VAR', 'unset')")).text, 'from create')
    assert.equal((await run("process.env.SANDBOX_VAR ?? 'unset'", { language: 'js' })).text, 'from create')
  })

  it('gives a matplotlib chart as a PNG', { timeout: TEST_TIMEOUT_MS }, async (t) => {
    if (problem) return skipOrFail(t, problem)
    const chart = await run('import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.show()')
    assert.equal(chart.error, undefined, JSON.stringify(chart.error))
    assert.ok(chart.results.length > 0 && chart.results[0].png, JSON.stringify(chart.results))
    assert.deepEqual(Buffer.from(chart.results[0].png, 'base64').subarray(0, 8), PNG_MAGIC)
  })

  it('gives a DataFrame as an HTML table', { timeout: TEST_TIMEOUT_MS }, async (t) => {
    if (problem) return skipOrFail(t, problem)
    const table = await run("import pandas as pd\npd.DataFrame({'a': [1, 2], 'b': [3, 4]})")
    assert.equal(table.error, undefined, JSON.stringify(table.error))
    const [result] = table.results
    assert.ok(result?.html?.includes('<table'), JSON.stringify(table.results))
    assert.equal(result.isMainResult, true)
    assert.ok(table.text?.includes('a'), table.text)
  })

  it("gives an exception as the execution's error, and the kernel goes on", { timeout: TEST_TIMEOUT_MS }, async (t) => {
    if (problem) return skipOrFail(t, problem)
    const errors = []
    const failed = await run('1 / 0', { onError: (error) => errors.push(error) })
    assert.ok(failed.error, 'an error')
    assert.equal(failed.error.name, 'ZeroDivisionError')
    assert.ok(failed.error.value.includes('division by zero'), failed.error.value)
    assert.ok(failed.error.traceback.includes('ZeroDivisionError'), failed.error.traceback)
    assert.deepEqual(failed.results, [])
    assert.deepEqual(errors.map((e) => e.name), ['ZeroDivisionError'])
    assert.equal((await run('x')).text, '2')
  })

  it('streams output to callbacks', { timeout: TEST_TIMEOUT_MS }, async (t) => {
    if (problem) return skipOrFail(t, problem)
    const stdout = []
    const stderr = []
    const results = []
    const done = await run("import sys\nprint('to out')\nprint('to err', file=sys.stderr)\n'the value'", {
      onStdout: (m) => stdout.push(m),
      onStderr: (m) => stderr.push(m),
      onResult: (r) => results.push(r),
    })
    assert.deepEqual(stdout.map((m) => [m.line, m.error]), [['to out\n', false]])
    assert.deepEqual(stderr.map((m) => [m.line, m.error]), [['to err\n', true]])
    assert.ok(stdout[0].timestamp > 0, String(stdout[0].timestamp))
    // A string's repr without its quotes: what E2B's own interpreter gives
    // (its tests expect `os.getenv('FOO')` to be `bar`).
    assert.deepEqual(results.map((r) => r.text), ['the value'])
    assert.deepEqual(done.logs, { stdout: ['to out\n'], stderr: ['to err\n'] })
  })
})
