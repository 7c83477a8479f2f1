// The stock `e2b` JS SDK's fork and snapshots against dsec (apiserver/e2b/snapshots.py).
import { Sandbox } from 'e2b'
import { check, done } from './check.mjs'

const sbx = await Sandbox.create('debian-python', { timeoutMs: 300_000, metadata: { suite: 'js-fork' } })
try {
  await sbx.files.write('/home/user/state.txt', 'prepared')
  const forks = await sbx.fork({ count: 2, timeoutMs: 60_000 })
  check(forks.length === 2 && forks.every((f) => f instanceof Sandbox), 'fork count', forks)
  try {
    for (const f of forks) {
      check(await f.files.read('/home/user/state.txt') === 'prepared', 'fork sees the parent files')
    }
    await forks[0].files.write('/home/user/state.txt', 'changed')
    check(await forks[1].files.read('/home/user/state.txt') === 'prepared', 'siblings apart')
    check(await sbx.files.read('/home/user/state.txt') === 'prepared', 'parent apart')
  } finally {
    for (const f of forks) if (f instanceof Sandbox) await f.kill()
  }
  const snap = await sbx.createSnapshot()
  check(snap.snapshotId.startsWith('snap-'), 'createSnapshot', snap)
  const listed = await sbx.listSnapshots().nextItems()
  check(listed.some((s) => s.snapshotId === snap.snapshotId), 'listSnapshots', listed)
  const made = await Sandbox.create(snap.snapshotId, { timeoutMs: 60_000 })
  try {
    check(await made.files.read('/home/user/state.txt') === 'prepared', 'create from snapshot')
    check(await Sandbox.deleteSnapshot(snap.snapshotId) === true, 'deleteSnapshot')
    check(await made.files.read('/home/user/state.txt') === 'prepared', 'made runs on after delete')
  } finally {
    await made.kill()
  }
} finally {
  await sbx.kill()
}
done()
