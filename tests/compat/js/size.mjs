// The stock `e2b` JS SDK: a sandbox made with metadata dsec.cpu_cores / dsec.memory_mb sees its
// own size in nproc, /proc/meminfo and `free` (D50).
import { Sandbox } from 'e2b'
import { check, done } from './check.mjs'

const sbx = await Sandbox.create('debian-python', {
  timeoutMs: 120_000, metadata: { 'dsec.cpu_cores': '1', 'dsec.memory_mb': '512' },
})
try {
  const r = await sbx.commands.run("nproc; head -1 /proc/meminfo; free -m | awk 'NR==2 {print $2}'")
  check(r.stdout.split(/\s+/).join(' ') === '1 MemTotal: 524288 kB 512 ', 'nproc, MemTotal, free', r.stdout)
} finally {
  await sbx.kill()
}
done()
