// Issue 24 items 6 and 7 with the npm SDK: signed download/upload URLs (E2B's v1 signature) work
// until they expire; a watcher sees a files.write as the events of a plain write, not dsec's
// temporary file.
import http from 'node:http'
import { Sandbox } from 'e2b'
import { check, done } from './check.mjs'

const server = new URL(process.env.DSEC_SERVER_URL)
// The URL's path and query, sent to the apiserver with the sandbox's envd name as Host (DNS stand-in)
function send(method, url, sandboxId, body) {
  const u = new URL(url)
  return new Promise((resolve, reject) => {
    const req = http.request({
      host: server.hostname, port: server.port, method, path: `/files${u.search}`,
      headers: { Host: `49983-${sandboxId}.${process.env.DSEC_E2B_DOMAIN}`,
                 ...(body ? { 'Content-Type': 'application/octet-stream' } : {}) },
    }, (res) => {
      let data = ''
      res.on('data', (c) => { data += c })
      res.on('end', () => resolve({ status: res.statusCode, body: data }))
    })
    req.on('error', reject)
    if (body) req.write(body)
    req.end()
  })
}

const sbx = await Sandbox.create('debian-python', { timeoutMs: 120_000 })
try {
  await sbx.files.write('/tmp/signed.txt', 'signed content')
  let r = await send('GET', await sbx.downloadUrl('/tmp/signed.txt'), sbx.sandboxId)
  check(r.status === 200 && r.body === 'signed content', 'signed download', r)
  r = await send('POST', await sbx.uploadUrl('/tmp/up.txt', { useSignatureExpiration: 60 }), sbx.sandboxId, 'uploaded')
  check(r.status === 200, 'signed upload', r)
  check(await sbx.files.read('/tmp/up.txt') === 'uploaded', 'uploaded content')
  const good = await sbx.downloadUrl('/tmp/signed.txt')
  r = await send('GET', good.replace('signed.txt', 'up.txt'), sbx.sandboxId)
  check(r.status === 401, 'a signature opens only its own path', r)
  r = await send('GET', await sbx.downloadUrl('/tmp/signed.txt', { useSignatureExpiration: -5 }), sbx.sandboxId)
  check(r.status === 401 && r.body.includes('expired'), 'an expired URL', r)

  await sbx.files.makeDir('/tmp/w')
  const events = []
  const watcher = await sbx.files.watchDir('/tmp/w', (e) => { events.push([e.type, e.name]) })
  await sbx.files.write('/tmp/w/a.txt', 'one')
  await sbx.files.write('/tmp/w/a.txt', 'two')
  for (let i = 0; i < 50 && events.filter(([t]) => t === 'write').length < 2; i++) await new Promise((ok) => setTimeout(ok, 100))
  await watcher.stop()
  check(events.every(([, name]) => name === 'a.txt'), 'only the written file is reported', events)
  check(events.some(([t]) => t === 'create') && events.filter(([t]) => t === 'write').length >= 2,
        'create then write, then write', events)
} finally {
  await sbx.kill()
}
done()
