// The stock `e2b` JS SDK's PTY against dsec: sandbox.pty.create/sendInput/resize/kill.
import { Sandbox } from 'e2b'
import { check, done } from './check.mjs'

const enc = new TextEncoder()
const dec = new TextDecoder()
let screen = ''
async function expect(re, ms = 20_000) {
  const end = Date.now() + ms
  while (!re.test(screen)) {
    check(Date.now() < end, `pty output ${re}`, screen.slice(-400))
    await new Promise((r) => setTimeout(r, 50))
  }
  screen = ''
}

const sbx = await Sandbox.create('debian-python', { timeoutMs: 120_000 })
try {
  const h = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => { screen += dec.decode(d) }, timeoutMs: 0 })
  check(h.pid > 0, 'pty.create', h.pid)
  await sbx.pty.sendInput(h.pid, enc.encode('echo $((6*7)); stty size\n'))
  await expect(/[\r\n]42\r\n24 80\r\n/)
  await sbx.pty.resize(h.pid, { cols: 120, rows: 40 })
  await sbx.pty.sendInput(h.pid, enc.encode('stty size\n'))
  await expect(/[\r\n]40 120\r\n/)
  await sbx.pty.sendInput(h.pid, enc.encode('sleep 600\n'))
  check(await sbx.pty.kill(h.pid) === true, 'pty.kill')
  let ended = false
  try { await h.wait() } catch (e) { ended = true }
  check(ended, 'the killed PTY ends')
  check(await sbx.pty.kill(h.pid) === false, 'pty.kill of an ended PTY')
} finally {
  await sbx.kill()
}
done()
