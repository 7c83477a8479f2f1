// The stock `e2b` JS SDK's network.rules header transforms (issue 30): accepted at create, the
// value kept outside the sandbox (only the trust bundle's path is in its environment);
// egressProxy accepted, its password outside too. The header itself arriving at its destination is shown
// with local HTTPS peers in tests/compat/test_e2b_secrets.py.
import { Sandbox } from 'e2b'
import { check, done } from './check.mjs'

const SECRET = 'sk-js-' + Math.random().toString(36).slice(2)
const sbx = await Sandbox.create('debian-python', {
  timeoutMs: 120_000,
  network: { allowOut: ['api.test'], denyOut: ['0.0.0.0/0'],
             rules: { 'api.test': [{ transform: { headers: { Authorization: `Bearer ${SECRET}` } } }] } } })
try {
  const env = (await sbx.commands.run("cat /proc/*/environ | tr '\\0' '\\n'", { user: 'root' })).stdout
  check(env.includes('SSL_CERT_FILE=/etc/dsec/egress-ca-bundle.pem'), 'the trust bundle is named', env)
  check(!env.includes(SECRET), 'the value is not in the sandbox environment')
  const bundle = await sbx.files.read('/etc/dsec/egress-ca-bundle.pem')
  check(bundle.includes('BEGIN CERTIFICATE') && !bundle.includes('PRIVATE KEY'), 'certificates only')
  const info = JSON.stringify(await Sandbox.getInfo(sbx.sandboxId))
  check(!info.includes(SECRET), 'the sandbox info does not return the value', info)
} finally {
  await sbx.kill()
}
// egressProxy (issue 30 item 3): accepted; its password stays outside too (the tunnel itself is
// shown with a local SOCKS5 server in tests/compat/test_e2b_socks.py); not together with rules
const tunnelled = await Sandbox.create('debian-python', {
  timeoutMs: 120_000,
  network: { allowOut: ['10.0.0.0/8'], egressProxy: { address: 'proxy.invalid:1080', username: 'u', password: SECRET } } })
try {
  const env = (await tunnelled.commands.run("cat /proc/*/environ | tr '\\0' '\\n'", { user: 'root' })).stdout
  check(env.includes('PATH=') && !env.includes(SECRET), 'the proxy password is not in the sandbox environment')
  const info = JSON.stringify(await Sandbox.getInfo(tunnelled.sandboxId))
  check(!info.includes(SECRET), 'the sandbox info does not return the proxy password', info)
} finally {
  await tunnelled.kill()
}
let refused = ''
try {
  await Sandbox.create('debian-python', { network: {
    allowOut: ['api.test'], egressProxy: { address: 'proxy.invalid:1080' },
    rules: { 'api.test': [{ transform: { headers: { X: 'y' } } }] } } })
} catch (e) { refused = String(e) }
check(refused.includes('network.egress_proxy') && refused.includes('SOCKS5'), 'egressProxy with rules refused by name', refused)
done()
