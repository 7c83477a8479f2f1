// The stock `e2b` JS SDK and issue 25 items 3 and 5: a create that names no network gets the
// internet (the root project allows it); getHost(port) names {port}-{id}.{DSEC_DOMAIN}, served
// over HTTPS with a certificate from the server's CA (DSEC_CA_FILE), the token kept out.
import fs from 'node:fs'
import https from 'node:https'
import { Sandbox } from 'e2b'
import { check, done } from './check.mjs'

const ECHO = `
import http.server, json
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({k.lower(): v for k, v in self.headers.items()}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
`

function get(host, token) {
  return new Promise((resolve) => {
    const req = https.request({ host: '127.0.0.1', port: Number(process.env.DSEC_HTTPS_PORT), servername: host,
      path: '/', headers: { Host: host, 'E2B-Traffic-Access-Token': token }, ca: fs.readFileSync(process.env.DSEC_CA_FILE) },
    (res) => { let b = ''; res.on('data', (c) => { b += c }); res.on('end', () => resolve({ status: res.statusCode, body: b })) })
    req.on('error', (e) => resolve({ status: 0, body: String(e) }))
    req.end()
  })
}

const sbx = await Sandbox.create('debian-python', { timeoutMs: 120_000 })
try {
  check((await sbx.getInfo()).allowInternetAccess === true, 'default internet on')
  await sbx.files.write('/tmp/echo.py', ECHO)
  await sbx.commands.run('python3 /tmp/echo.py', { background: true })
  const host = sbx.getHost(8000)
  check(host === `8000-${sbx.sandboxId}.${process.env.DSEC_E2B_DOMAIN}`, 'getHost', host)
  let r
  for (let i = 0; i < 100; i++) {
    r = await get(host, sbx.trafficAccessToken)
    if (r.status === 200) break
    await new Promise((ok) => setTimeout(ok, 300))
  }
  check(r.status === 200, 'HTTPS by name', r)
  const seen = JSON.parse(r.body)
  check(!('e2b-traffic-access-token' in seen) && !r.body.includes(sbx.trafficAccessToken), 'token kept out', seen)
} finally {
  await sbx.kill()
}
done()
