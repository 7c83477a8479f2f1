// The JSON API, with the key of this tab: sessionStorage (gone when the tab closes), sent
// as the Authorization header only, never in a URL.

const KEY = 'dsec.key';

export const session = {
  get key() { return sessionStorage.getItem(KEY); },
  set(key) { sessionStorage.setItem(KEY, key); },
  clear() { sessionStorage.removeItem(KEY); },
};

export class ApiError extends Error {
  constructor(status, error) {
    const e = error || {};
    super(`${status}: ${e.message || 'request failed'}${e.fix ? ` (${e.fix})` : ''}`);
    this.status = status;
    this.code = e.code;
    this.field = e.field;
  }
}

export function url(path, params = {}) {
  const u = new URL(path, location.origin);
  for (const [k, v] of Object.entries(params)) {
    for (const one of Array.isArray(v) ? v : [v]) {
      if (one != null && one !== '') u.searchParams.append(k, String(one));
    }
  }
  return u;
}

export function headers(accept = 'application/json') {
  return { Authorization: `Bearer ${session.key}`, Accept: accept };
}

// GET path?params as JSON (or text); a 401 ends the session (the key was revoked).
export async function get(path, params = {}, { signal, text = false } = {}) {
  const r = await fetch(url(path, params), { headers: headers(text ? 'text/plain' : 'application/json'),
    signal, cache: 'no-store', credentials: 'omit', referrerPolicy: 'no-referrer' });
  if (!r.ok) {
    const body = await r.json().catch(() => null);
    if (r.status === 401) window.dispatchEvent(new Event('dsec-logout'));
    throw new ApiError(r.status, body && body.error);
  }
  return text ? r.text() : r.json();
}

// Prometheus text: the samples of one metric, [{labels, value}].
export function samples(text, name) {
  const out = [];
  const re = new RegExp(`^${name}(?:\\{(.*)\\})? ([^ ]+)`);
  for (const line of text.split('\n')) {
    const m = re.exec(line);
    if (!m) continue;
    const labels = {};
    for (const l of (m[1] || '').matchAll(/([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"/g)) labels[l[1]] = l[2];
    out.push({ labels, value: Number(m[2]) });
  }
  return out;
}
