// E2B's lifecycle events API and webhooks from node (the stock JS SDK has no client for them:
// called with fetch and the SDK's env, as E2B's docs show): a sandbox the stock SDK creates and
// kills shows as create and kill, and a webhook registers, lists and deletes.
import { Sandbox } from 'e2b'
import { check, done } from './check.mjs'

const api = process.env.E2B_API_URL
const headers = { 'X-API-Key': process.env.E2B_API_KEY, 'Content-Type': 'application/json' }

const made = await fetch(`${api}/events/webhooks`, {
  method: 'POST', headers,
  body: JSON.stringify({ name: 'js', url: 'http://127.0.0.1:9/js', enabled: true,
    events: ['sandbox.lifecycle.killed'], signatureSecret: 'js-secret' }),
})
check(made.status === 201, 'register webhook', await made.clone().text())
const hook = await made.json()
try {
  const listed = await (await fetch(`${api}/events/webhooks`, { headers })).json()
  check(listed.some((h) => h.id === hook.id && h.events[0] === 'sandbox.lifecycle.killed'), 'list webhooks', listed)
  const sbx = await Sandbox.create('busybox', { timeoutMs: 60_000 })
  await sbx.kill()
  let labels = []
  for (let i = 0; i < 60 && !labels.includes('kill'); i++) {     // the apiserver pulls events each second
    await new Promise((r) => setTimeout(r, 500))
    const evs = await (await fetch(`${api}/events/sandboxes/${sbx.sandboxId}?orderAsc=true`, { headers })).json()
    labels = evs.map((e) => e.eventLabel)
  }
  check(labels[0] === 'create' && labels.at(-1) === 'kill', 'events of the sandbox', labels)
} finally {
  const del = await fetch(`${api}/events/webhooks/${hook.id}`, { method: 'DELETE', headers })
  check(del.status === 200, 'delete webhook', del.status)
}
done()
