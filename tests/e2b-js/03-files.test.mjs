// Files through envd (`/files` for contents, the filesystem service for the
// rest), in one sandbox of this file: text, an ArrayBuffer and a Uint8Array
// written and read back (as text and as bytes), list, exists, getInfo,
// rename, remove, makeDir, a missing file, and a directory watch. Each test
// works under a directory of its own.

import assert from 'node:assert/strict'
import { createHash, randomUUID } from 'node:crypto'
import { after, before, beforeEach, describe, it } from 'node:test'

import { FileNotFoundError, FileType, FilesystemEventType } from 'e2b'

import { COMMAND_TIMEOUT_MS, TEST_TIMEOUT_MS, killQuietly, newSandbox, notHere, waitFor } from './helpers.mjs'

describe('files', { skip: notHere }, () => {
  let sandbox
  // A fresh directory (not made yet) in the user's home, for each test.
  let workdir
  const shell = async (cmd) => (await sandbox.commands.run(cmd, { timeoutMs: COMMAND_TIMEOUT_MS })).stdout

  before(async () => {
    sandbox = await newSandbox({ metadata: { purpose: 'files' } })
  }, { timeout: TEST_TIMEOUT_MS })

  after(async () => {
    await killQuietly(sandbox)
  }, { timeout: TEST_TIMEOUT_MS })

  beforeEach(() => {
    workdir = `/home/user/e2b-js-${randomUUID().slice(0, 8)}`
  })

  it('writes text and bytes and reads them back', { timeout: TEST_TIMEOUT_MS }, async () => {
    const written = await sandbox.files.write(`${workdir}/nested/hello.txt`, 'héllo\nworld\n')
    assert.deepEqual(
      { name: written.name, path: written.path, type: written.type },
      { name: 'hello.txt', path: `${workdir}/nested/hello.txt`, type: FileType.FILE },
    )
    assert.equal(await sandbox.files.read(`${workdir}/nested/hello.txt`), 'héllo\nworld\n')
    assert.equal(await sandbox.files.read(`${workdir}/nested/hello.txt`, { format: 'text' }), 'héllo\nworld\n')

    // Every byte value, as an ArrayBuffer.
    const everyByte = new Uint8Array(1024).map((_, i) => i % 256)
    await sandbox.files.write(`${workdir}/bytes.bin`, everyByte.buffer)
    const read = await sandbox.files.read(`${workdir}/bytes.bin`, { format: 'bytes' })
    assert.ok(read instanceof Uint8Array, Object.prototype.toString.call(read))
    assert.deepEqual(Buffer.from(read), Buffer.from(everyByte))
    // What the guest sees is what was written.
    const digest = (await shell(`sha256sum ${workdir}/bytes.bin`)).split(' ')[0]
    assert.equal(digest, createHash('sha256').update(everyByte).digest('hex'))

    // A Uint8Array (a view, not the whole of its buffer) writes what it shows; writing again replaces.
    const backing = new TextEncoder().encode('xxshortxx')
    await sandbox.files.write(`${workdir}/bytes.bin`, backing.subarray(2, 7))
    assert.deepEqual(Buffer.from(await sandbox.files.read(`${workdir}/bytes.bin`, { format: 'bytes' })),
      Buffer.from('short'))

    // Files are the default user's.
    assert.equal(await shell(`stat -c %U ${workdir}/nested/hello.txt`), 'user\n')
    await assert.rejects(sandbox.files.read(`${workdir}/missing.txt`), FileNotFoundError)
  })

  it('lists, inspects, renames and removes, and makes directories', { timeout: TEST_TIMEOUT_MS }, async () => {
    assert.equal(await sandbox.files.makeDir(workdir), true)
    assert.equal(await sandbox.files.makeDir(workdir), false)
    await sandbox.files.write(`${workdir}/a.txt`, '12345')
    assert.equal(await sandbox.files.makeDir(`${workdir}/sub/deeper`), true)

    const entries = Object.fromEntries((await sandbox.files.list(workdir)).map((e) => [e.name, e]))
    assert.deepEqual(Object.keys(entries).sort(), ['a.txt', 'sub'])
    assert.equal(entries['a.txt'].type, FileType.FILE)
    assert.equal(entries['a.txt'].size, 5)
    assert.equal(entries['a.txt'].path, `${workdir}/a.txt`)
    assert.equal(entries.sub.type, FileType.DIR)
    const deep = (await sandbox.files.list(workdir, { depth: 2 })).map((e) => e.path)
    assert.ok(deep.includes(`${workdir}/sub/deeper`), JSON.stringify(deep))

    const info = await sandbox.files.getInfo(`${workdir}/a.txt`)
    assert.deepEqual(
      { name: info.name, type: info.type, size: info.size, path: info.path },
      { name: 'a.txt', type: FileType.FILE, size: 5, path: `${workdir}/a.txt` },
    )
    assert.equal(info.owner, 'user')
    assert.ok(info.permissions.startsWith('-rw'), info.permissions)
    assert.ok(info.modifiedTime instanceof Date, String(info.modifiedTime))
    assert.equal((await sandbox.files.getInfo(workdir)).type, FileType.DIR)

    assert.equal(await sandbox.files.exists(`${workdir}/a.txt`), true)
    assert.equal(await sandbox.files.exists(`${workdir}/nothing`), false)

    const renamed = await sandbox.files.rename(`${workdir}/a.txt`, `${workdir}/b.txt`)
    assert.deepEqual({ name: renamed.name, path: renamed.path }, { name: 'b.txt', path: `${workdir}/b.txt` })
    assert.equal(await sandbox.files.exists(`${workdir}/a.txt`), false)
    assert.equal(await sandbox.files.read(`${workdir}/b.txt`), '12345')

    await sandbox.files.remove(`${workdir}/b.txt`)
    assert.equal(await sandbox.files.exists(`${workdir}/b.txt`), false)
    await sandbox.files.remove(`${workdir}/sub`) // a directory with what is in it
    assert.deepEqual(await sandbox.files.list(workdir), [])

    await assert.rejects(sandbox.files.list(`${workdir}/nothing`), FileNotFoundError)
    await assert.rejects(sandbox.files.getInfo(`${workdir}/nothing`), FileNotFoundError)
  })

  it('watches a directory: a file written and removed in it', { timeout: TEST_TIMEOUT_MS }, async () => {
    await sandbox.files.makeDir(workdir)
    const seen = []
    const watch = await sandbox.files.watchDir(workdir, (event) => { seen.push(event) }, { timeoutMs: 0 })
    const saw = (...kinds) => seen.some((e) => e.name === 'new.txt' && kinds.includes(e.type))
    try {
      await sandbox.files.write(`${workdir}/new.txt`, 'watched')
      await waitFor(() => saw(FilesystemEventType.CREATE, FilesystemEventType.WRITE),
        { timeoutMs: 60_000, what: () => `a create or write event for new.txt (seen: ${JSON.stringify(seen)})` })
      await sandbox.files.remove(`${workdir}/new.txt`)
      await waitFor(() => saw(FilesystemEventType.REMOVE),
        { timeoutMs: 60_000, what: () => `a remove event for new.txt (seen: ${JSON.stringify(seen)})` })
    } finally {
      await watch.stop()
    }
  })
})
