// The stock `e2b` JS SDK's Volume API and volumeMounts, and lifecycle { onTimeout: 'pause' }
// (auto-pause at the timeout, resumed by the next envd call) against dsec.
import { Sandbox, Volume } from 'e2b'
import { check, done } from './check.mjs'

const name = `js-${Math.random().toString(16).slice(2, 10)}`
const vol = await Volume.create(name)
check(vol.name === name && vol.volumeId.startsWith('vol-'), 'Volume.create', vol)
check((await Volume.list()).some((v) => v.name === name), 'Volume.list has it')
try {
  const a = await Sandbox.create('busybox', { timeoutMs: 2_000, volumeMounts: { '/data': vol },
                                              lifecycle: { onTimeout: 'pause', autoResume: true } })
  try {
    const info = await a.getInfo()
    check(info.lifecycle?.onTimeout === 'pause' && info.lifecycle?.autoResume === true, 'lifecycle in info', info.lifecycle)
    await a.commands.run('echo from-js > /data/f')
    let state = 'running'
    const deadline = Date.now() + 60_000
    while (state !== 'paused' && Date.now() < deadline) {
      state = (await Sandbox.getInfo(a.sandboxId)).state
      await new Promise((r) => setTimeout(r, 200))
    }
    check(state === 'paused', 'paused at its timeout', state)
    const out = await a.commands.run('cat /data/f')      // envd resumes it
    check(out.stdout === 'from-js\n', 'resumed with the volume', out)
  } finally {
    await a.kill()
  }
  const b = await Sandbox.create('busybox', { timeoutMs: 60_000, volumeMounts: { '/v': name } })
  try {
    check((await b.commands.run('cat /v/f')).stdout === 'from-js\n', 'another sandbox sees the file')
  } finally {
    await b.kill()
  }
} finally {
  check(await Volume.destroy(vol.volumeId) === true, 'Volume.destroy')
}
check(await Volume.destroy(vol.volumeId) === false, 'destroy of a gone volume is false')
done()
