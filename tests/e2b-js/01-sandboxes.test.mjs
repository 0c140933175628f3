// Sandboxes through E2B's control plane, in one sandbox of this file:
// create with metadata and environment variables, a command that sees
// them, list by metadata (a paginator), getInfo, connect, the wall between
// workspaces (another workspace's key finds nothing), a wrong API key, then
// kill (a command it ran says the sandbox is gone), after which connect
// rejects.

import assert from 'node:assert/strict'
import { after, before, describe, it } from 'node:test'

import { AuthenticationError, NotFoundError, Sandbox, SandboxNotFoundError, TimeoutError } from 'e2b'

import {
  COMMAND_TIMEOUT_MS, OTHER_API_KEY, REQUEST_TIMEOUT_MS, RUN, TEMPLATE, TEST_TIMEOUT_MS, killQuietly, listAll,
  listedIds, newSandbox, notHere,
} from './helpers.mjs'

const opts = { requestTimeoutMs: REQUEST_TIMEOUT_MS }
const WRONG_KEY = 'e2b_' + '0'.repeat(40)

describe('a sandbox through the control plane', { skip: notHere }, () => {
  let sandbox

  before(async () => {
    sandbox = await newSandbox({ metadata: { purpose: 'listed' }, envs: { FOO: 'bar' } })
  }, { timeout: TEST_TIMEOUT_MS })

  after(async () => {
    await killQuietly(sandbox)
  }, { timeout: TEST_TIMEOUT_MS })

  it('is created with its id and runs a command with its environment variables', { timeout: TEST_TIMEOUT_MS }, async () => {
    assert.ok(sandbox.sandboxId)
    const result = await sandbox.commands.run('echo $FOO', { timeoutMs: COMMAND_TIMEOUT_MS })
    assert.equal(result.stdout, 'bar\n')
    assert.equal(result.exitCode, 0)
  })

  it('is listed by its metadata, and by its state', { timeout: TEST_TIMEOUT_MS }, async () => {
    const paginator = Sandbox.list({ query: { metadata: { purpose: 'listed', run: RUN } }, ...opts })
    assert.equal(paginator.hasNext, true)
    const page = await paginator.nextItems()
    assert.deepEqual(page.map((s) => s.sandboxId), [sandbox.sandboxId])
    assert.equal(page[0].metadata.purpose, 'listed')
    assert.equal(page[0].state, 'running')
    assert.equal(paginator.hasNext, false, 'one page only')

    assert.ok((await listedIds()).includes(sandbox.sandboxId))
    assert.deepEqual(
      await listedIds({ query: { metadata: { run: RUN, purpose: 'listed' }, state: ['running'] } }),
      [sandbox.sandboxId],
    )
    assert.deepEqual(await listedIds({ query: { metadata: { run: RUN }, state: ['paused'] } }), [])
    assert.deepEqual(await listAll({ query: { metadata: { purpose: 'nothing-has-this' } } }), [])
  })

  it('has its information', { timeout: TEST_TIMEOUT_MS }, async () => {
    const info = await sandbox.getInfo(opts)
    assert.equal(info.sandboxId, sandbox.sandboxId)
    assert.equal(info.metadata.purpose, 'listed')
    assert.equal(info.metadata.run, RUN)
    assert.equal(info.state, 'running')
    // E2B answers the template's id and its alias (`name`); either is the name asked for here.
    assert.ok([info.templateId, info.name].includes(TEMPLATE), `${info.templateId} ${info.name}`)
    assert.ok(info.startedAt instanceof Date && !Number.isNaN(info.startedAt.getTime()), String(info.startedAt))
    assert.ok(info.startedAt <= info.endAt, `${info.startedAt} ${info.endAt}`)
    assert.ok(info.envdVersion)
    assert.equal((await Sandbox.getInfo(sandbox.sandboxId, opts)).sandboxId, sandbox.sandboxId)
  })

  it('is connected to by its id: another handle on the same sandbox', { timeout: TEST_TIMEOUT_MS }, async () => {
    const again = await Sandbox.connect(sandbox.sandboxId, opts)
    assert.equal(again.sandboxId, sandbox.sandboxId)
    assert.equal((await again.commands.run('echo $FOO', { timeoutMs: COMMAND_TIMEOUT_MS })).stdout, 'bar\n')
  })

  it('is not found with a key of another workspace', { timeout: TEST_TIMEOUT_MS }, async () => {
    const other = { apiKey: OTHER_API_KEY, ...opts }
    await assert.rejects(Sandbox.connect(sandbox.sandboxId, other), SandboxNotFoundError)
    await assert.rejects(Sandbox.getInfo(sandbox.sandboxId, other), NotFoundError)
    await assert.rejects(Sandbox.setTimeout(sandbox.sandboxId, 60_000, other), NotFoundError)
    assert.equal(await Sandbox.kill(sandbox.sandboxId, other), false)
    assert.ok(!(await listedIds({ apiKey: OTHER_API_KEY })).includes(sandbox.sandboxId))
    // Still there for its own workspace.
    const still = await sandbox.commands.run('echo still-here', { timeoutMs: COMMAND_TIMEOUT_MS })
    assert.equal(still.stdout, 'still-here\n')
  })

  it('is refused with a wrong API key: an authentication error', { timeout: TEST_TIMEOUT_MS }, async () => {
    await assert.rejects(listAll({ apiKey: WRONG_KEY }), AuthenticationError)
    await assert.rejects(Sandbox.connect(sandbox.sandboxId, { apiKey: WRONG_KEY, ...opts }), AuthenticationError)
  })

  it('is killed, and then neither found nor listed', { timeout: TEST_TIMEOUT_MS }, async () => {
    assert.equal(await sandbox.isRunning(opts), true)
    const command = await sandbox.commands.run('sleep 600', { background: true, timeoutMs: 0 })
    assert.equal(await sandbox.kill(opts), true)
    // As on E2B: the command's stream is cut with its sandbox, and the SDK,
    // whose health probe then finds the sandbox gone, says so.
    await assert.rejects(command.wait(), (err) => {
      assert.ok(err instanceof TimeoutError && /killed or reached its end of life/.test(err.message), err)
      return true
    })

    await assert.rejects(Sandbox.connect(sandbox.sandboxId, opts), SandboxNotFoundError)
    await assert.rejects(Sandbox.getInfo(sandbox.sandboxId, opts), SandboxNotFoundError)
    assert.equal(await Sandbox.kill(sandbox.sandboxId, opts), false)
    assert.ok(!(await listedIds()).includes(sandbox.sandboxId))
    assert.equal(await sandbox.isRunning(opts), false)
    await assert.rejects(sandbox.commands.run('true', { timeoutMs: COMMAND_TIMEOUT_MS }))
  })

  it('is not found when it never was', { timeout: TEST_TIMEOUT_MS }, async () => {
    await assert.rejects(Sandbox.connect('sandbox-that-never-was', opts), SandboxNotFoundError)
    assert.equal(await Sandbox.kill('sandbox-that-never-was', opts), false)
  })
})
