// The stock `e2b` JS SDK's egress by domain (issue 25): allowOut with names, updateNetwork (PUT
// /sandboxes/{id}/network). The test server's DNS upstream is a closed local port, so an allowed
// name gets SERVFAIL from the node's forwarder and a name outside the policy REFUSED.
import { Sandbox } from 'e2b'
import { check, done } from './check.mjs'

const RCODE = `
import socket, struct, sys
q = struct.pack(">HHHHHH", 7, 0x0100, 1, 0, 0, 0)
q += b"".join(bytes([len(p)]) + p.encode() for p in sys.argv[1].split(".")) + b"\\0" + struct.pack(">HH", 1, 1)
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(5)
try:
    s.sendto(q, ("192.0.2.53", 53)); print(s.recv(512)[3] & 15)
except OSError as e:
    print("err", e.errno)
`
const rcode = async (sbx, name) => (await sbx.commands.run(`python3 /tmp/rcode.py ${name}`, { user: 'root' })).stdout.trim()

const sbx = await Sandbox.create('debian-python', {
  timeoutMs: 120_000, network: { allowOut: ['allowed.test'], denyOut: ['0.0.0.0/0'] } })
try {
  await sbx.files.write('/tmp/rcode.py', RCODE)
  const conf = await sbx.files.read('/etc/resolv.conf')
  check(conf.startsWith('nameserver '), 'resolv.conf names the forwarder', conf)
  check(await rcode(sbx, 'allowed.test') === '2', 'allowed name relayed upstream (SERVFAIL from the sink)')
  check(await rcode(sbx, 'other.test') === '5', 'other name REFUSED by the forwarder')
  await sbx.updateNetwork({ allowOut: ['other.test'], denyOut: ['0.0.0.0/0'] })
  check(await rcode(sbx, 'allowed.test') === '5' && await rcode(sbx, 'other.test') === '2', 'updateNetwork')
  await sbx.updateNetwork({ denyOut: ['0.0.0.0/0'] })
  check((await rcode(sbx, 'other.test')).startsWith('err 1'), 'no egress: no DNS (EPERM)')
  let refused = ''
  try { await sbx.updateNetwork({ allowOut: ['bad_name!'] }) } catch (e) { refused = String(e) }
  check(refused.includes('network.allowOut'), 'a bad name is refused naming the field', refused)
} finally {
  await sbx.kill()
}
done()
