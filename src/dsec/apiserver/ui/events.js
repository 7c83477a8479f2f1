// Lifecycle events (GET /v1/events: NDJSON or server-sent events, or a JSON list), read as
// they come. Where this apiserver has no such route, the caller shows "events not available".

import { ApiError, headers, url } from './api.js';

export const UNAVAILABLE = 'unavailable';

// Calls onEvent(event) for each event until the stream ends or `signal` aborts; returns
// UNAVAILABLE when the route does not exist.
export async function follow(params, onEvent, signal) {
  const r = await fetch(url('/v1/events', params), {
    headers: headers('application/x-ndjson, text/event-stream, application/json'),
    signal, cache: 'no-store', credentials: 'omit', referrerPolicy: 'no-referrer',
  });
  if (r.status === 404 || r.status === 405 || r.status === 501) {
    const body = await r.json().catch(() => null);
    const msg = (body && body.error && body.error.message) || '';
    if (r.status !== 404 || msg.startsWith('no route')) return UNAVAILABLE;
    throw new ApiError(r.status, body && body.error);
  }
  if (!r.ok) throw new ApiError(r.status, (await r.json().catch(() => null) || {}).error);
  const type = r.headers.get('content-type') || '';
  if (type.startsWith('application/json')) {
    const body = await r.json();
    for (const e of Array.isArray(body) ? body : body.events || []) onEvent(e);
    return 'ended';
  }
  const reader = r.body.getReader();
  const dec = new TextDecoder();
  let buf = '', data = [];
  const line = (l) => {
    if (l.startsWith('data:')) data.push(l.slice(5).trimStart());
    else if (l === '' && data.length) { emit(data.join('\n')); data = []; }
    else if (l.startsWith('{')) emit(l);          // NDJSON
  };
  const emit = (text) => { try { onEvent(JSON.parse(text)); } catch { /* a keep-alive or a partial line */ } };
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf('\n')) >= 0) { line(buf.slice(0, i).replace(/\r$/, '')); buf = buf.slice(i + 1); }
  }
  if (buf) line(buf);
  line('');
  return 'ended';
}

// Recent events, paged (`?after=ID&limit=`, oldest first, `last_id` the next cursor) until a
// short page or the deadline; each page handed to onPage. UNAVAILABLE without the route.
export async function recent(params, onPage, signal, deadlineMs = 3000) {
  const until = Date.now() + deadlineMs;
  let after = 0;
  for (let i = 0; i < 50 && Date.now() < until; i++) {
    let body = null;
    const got = await follow({ ...params, after, limit: 1000 }, (e) => { (body = body || []).push(e); }, signal);
    if (got === UNAVAILABLE) return UNAVAILABLE;
    onPage(body || []);
    if (!body || body.length < 1000) break;
    after = body[body.length - 1].id || after;
    if (!after) break;
  }
  return 'ended';
}

// The fields of an event whatever its exact shape: when, what, why, which sandbox.
export function describe(e) {
  const when = e.timestamp || e.time || e.created_at || e.at;
  const t = typeof when === 'number' ? new Date(when * 1000) : when ? new Date(when) : null;
  return {
    when: t && !isNaN(t) ? t.toISOString().replace('T', ' ').slice(0, 19) : '',
    type: e.type || e.event || e.kind || '',
    reason: e.reason || (e.data && e.data.reason) || '',
    sandbox: e.sandbox_id || e.sandboxId || e.sandbox || '',
    message: e.message || '',
    infrastructure: e.infrastructure,
    at: t,
  };
}
