// What the E2B JS suite's test files share: its timeouts, the run's tag,
// sandboxes made and killed the suite's way, listing every page, waiting,
// and the skip-or-fail rule. The environment comes from tests/e2b-js/run.py
// (scripts/test-e2b-js): E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY point
// the unmodified SDKs at one real `clade server`.

import { Sandbox } from 'e2b'

// Milliseconds an SDK request may take (its default is 60 s): a create or a
// connect boots or restores a VM, under QEMU TCG on a loaded 2-core machine.
export const REQUEST_TIMEOUT_MS = 120_000
// Milliseconds a sandbox of this suite lives unused: longer than the suite.
export const SANDBOX_TIMEOUT_MS = 3_600_000
// Milliseconds a short command may take end to end (bash -l under TCG is slow).
export const COMMAND_TIMEOUT_MS = 120_000
// A test's own limit (node:test's default is none): a hung server, VM or
// stream fails its test instead of hanging the suite.
export const TEST_TIMEOUT_MS = 600_000
// Clade's small image; E2B's `base` template has the same name.
export const TEMPLATE = 'base'
// Tags every sandbox of this run, so that listing by metadata finds only ours.
export const RUN = process.env.E2B_JS_RUN ?? 'unset'
// A key of another workspace of the same server.
export const OTHER_API_KEY = process.env.E2B_JS_OTHER_API_KEY

export function inCi() {
  return !['', 'false', '0'].includes(process.env.CI ?? '')
}

// Why these tests cannot run here, or false: they need the server
// run.py starts. The option `skip` of a suite's describe().
export const notHere = process.env.E2B_API_URL && process.env.E2B_JS_OTHER_API_KEY
  ? false
  : 'no server: run the suite with scripts/test-e2b-js'
if (notHere && inCi()) {
  throw new Error(`required in CI: ${notHere}`)
}

// Skips the calling test (`t`, its TestContext) with the reason, or fails
// it when `CI` is set. Returns so that the caller can stop: `return skipOrFail(t, ...)`.
export function skipOrFail(t, reason) {
  if (inCi()) {
    throw new Error(`required for this test in CI: ${reason}`)
  }
  t.skip(reason)
}

// `Sandbox.create` (of `cls`, e.g. the code interpreter's) with this
// suite's template, timeouts and run tag.
export async function newSandbox({ cls = Sandbox, metadata = {}, ...opts } = {}) {
  return cls.create({
    template: TEMPLATE,
    timeoutMs: SANDBOX_TIMEOUT_MS,
    requestTimeoutMs: REQUEST_TIMEOUT_MS,
    ...opts,
    metadata: { run: RUN, ...metadata },
  })
}

export async function killQuietly(sandboxOrId, opts = {}) {
  if (!sandboxOrId) return
  const id = typeof sandboxOrId === 'string' ? sandboxOrId : sandboxOrId.sandboxId
  try {
    await Sandbox.kill(id, { requestTimeoutMs: REQUEST_TIMEOUT_MS, ...opts })
  } catch {
    // cleanup after a test: what failed is already reported
  }
}

// Every page of `Sandbox.list(opts)`.
export async function listAll(opts = {}) {
  const paginator = Sandbox.list({ requestTimeoutMs: REQUEST_TIMEOUT_MS, ...opts })
  const found = []
  while (paginator.hasNext) {
    found.push(...(await paginator.nextItems()))
  }
  return found
}

export async function listedIds(opts = {}) {
  return (await listAll(opts)).map((info) => info.sandboxId)
}

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms))

// Polls `predicate` (may be async) until it gives a truthy value, which it
// returns. `what` (a string, or a function giving one at the deadline) names
// what was waited for in the error.
export async function waitFor(predicate, { timeoutMs = 30_000, intervalMs = 200, what = 'condition' } = {}) {
  const deadline = Date.now() + timeoutMs
  for (;;) {
    const value = await predicate()
    if (value) return value
    if (Date.now() > deadline) {
      const named = typeof what === 'function' ? what() : what
      throw new Error(`timed out after ${Math.round(timeoutMs / 1000)} s waiting for ${named}`)
    }
    await sleep(intervalMs)
  }
}

// What `promise` settles to (its value, or the error it rejects with), or
// `onTimeout` when it has not settled within `ms`.
export async function settledWithin(promise, ms, onTimeout = 'not settled') {
  let timer
  const late = new Promise((resolve) => { timer = setTimeout(() => resolve(onTimeout), ms) })
  try {
    return await Promise.race([promise.then((value) => value, (err) => err), late])
  } finally {
    clearTimeout(timer)
  }
}
