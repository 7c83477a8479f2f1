// The stock `e2b` JS SDK's core path against dsec: create, commands, files, list, kill.
import { Sandbox } from 'e2b'
import { check, done } from './check.mjs'

const sbx = await Sandbox.create('debian-python', { timeoutMs: 120_000, metadata: { suite: 'js-core' } })
try {
  const r = await sbx.commands.run('echo hello; echo oops >&2')
  check(r.exitCode === 0 && r.stdout === 'hello\n' && r.stderr === 'oops\n', 'commands.run', r)
  await sbx.files.write('/tmp/js.txt', 'from node')
  check(await sbx.files.read('/tmp/js.txt') === 'from node', 'files.read')
  const names = (await sbx.files.list('/tmp')).map((e) => e.name)
  check(names.includes('js.txt'), 'files.list', names)
  const listed = await Sandbox.list({ query: { metadata: { suite: 'js-core' } } }).nextItems()
  check(listed.some((s) => s.sandboxId === sbx.sandboxId), 'Sandbox.list', listed)
} finally {
  await sbx.kill()
}
check(!(await sbx.isRunning()), 'kill')
done()
