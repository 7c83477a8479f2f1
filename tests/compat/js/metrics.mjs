// The stock `e2b` JS SDK's getMetrics (GET /sandboxes/{id}/metrics) against dsec's usage samples.
import { Sandbox } from 'e2b'
import { check, done } from './check.mjs'

const sbx = await Sandbox.create('debian-python', { timeoutMs: 120_000 })
try {
  await sbx.commands.run("sh -c 'while true; do :; done' >/dev/null 2>&1 &")
  await new Promise((r) => setTimeout(r, 1500))
  const m = await sbx.getMetrics()
  check(m.length >= 1, 'getMetrics returns samples', m)
  const last = m[m.length - 1]
  check(last.timestamp instanceof Date && !isNaN(last.timestamp.getTime()), 'timestamp is a date', last)
  check(last.cpuCount >= 1 && last.cpuUsedPct > 0, 'cpu figures', last)
  check(last.memTotal > 0 && last.memUsed > 0 && last.memUsed <= last.memTotal, 'memory figures', last)
  check(last.diskTotal >= last.diskUsed, 'disk figures', last)
  const byId = await Sandbox.getMetrics(sbx.sandboxId)
  check(byId.length >= 1, 'Sandbox.getMetrics(id)', byId)
  const later = await sbx.getMetrics({ start: new Date(Date.now() + 3600_000) })
  check(later.length === 0, 'getMetrics start filters', later)
} finally {
  await sbx.kill()
}
done()
