// The stock `e2b` JS SDK and E2B's user layout (issue 24, items 3 and 4): the default user is
// `user` at home in /home/user; file calls act as the user they name (root's files are root's).
import { Sandbox } from 'e2b'
import { check, done } from './check.mjs'

async function refused(call, what, pattern) {
  try {
    await call()
  } catch (e) {
    check(pattern.test(String(e.message)), `${what}: the error names the reason`, String(e.message))
    return
  }
  check(false, `${what}: refused`)
}

const sbx = await Sandbox.create('debian-python', { timeoutMs: 120_000, metadata: { suite: 'js-users' } })
try {
  const r = await sbx.commands.run('whoami; pwd; echo $HOME; stat -c %U:%G /home/user')
  check(r.stdout === 'user\n/home/user\n/home/user\nuser:user\n', 'default user and home', r.stdout)
  await sbx.files.write('rel.txt', 'relative')
  check((await sbx.commands.run('cat /home/user/rel.txt')).stdout === 'relative', 'relative path in the home')
  await sbx.files.write('/root/js', 'secret', { user: 'root' })
  check(await sbx.files.read('/root/js', { user: 'root' }) === 'secret', 'read as root')
  const owner = await sbx.commands.run('stat -c %u:%g /root/js', { user: 'root' })
  check(owner.stdout === '0:0\n', 'root owns what root writes', owner.stdout)
  await refused(() => sbx.files.read('/root/js'), 'read of root\'s file as the default user', /permission denied/i)
  check((await sbx.files.list('/root', { user: 'root' })).some((e) => e.name === 'js'), 'list as root')
  await sbx.files.write('/tmp/by-user', 'u', { user: 'user' })
  check((await sbx.commands.run('stat -c %U /tmp/by-user')).stdout === 'user\n', 'written as user')
  await sbx.files.remove('/root/js', { user: 'root' })
  check(!(await sbx.files.exists('/root/js', { user: 'root' })), 'removed as root')
  await refused(() => sbx.files.write('/tmp/x', 'x', { user: 'no-such-user' }), 'unknown user', /no-such-user/)
} finally {
  await sbx.kill()
}
done()
