// Building the page: every value goes in as text (never innerHTML): a sandbox's labels,
// error or events are other people's strings.

export function el(tag, attrs = {}, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v == null || v === false) continue;
    if (k === 'class') e.className = v;
    else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? '' : String(v));
  }
  for (const kid of kids.flat(Infinity)) {
    if (kid == null || kid === false) continue;
    e.append(kid instanceof Node ? kid : String(kid));
  }
  return e;
}

export function table(headers, rows) {
  return el('table', {}, el('thead', {}, el('tr', {}, headers.map((h) => el('th', {}, h)))),
    el('tbody', {}, rows));
}

export function bar(fraction, text) {
  const f = Math.max(0, Math.min(1, Number(fraction) || 0));
  const cls = f >= 0.9 ? 'bar bad' : f >= 0.7 ? 'bar warn' : 'bar';
  const inner = el('i');
  inner.style.width = `${(f * 100).toFixed(1)}%`;   // CSSOM, not a style attribute: CSP allows it
  return el('span', {}, el('span', { class: cls, title: `${(f * 100).toFixed(0)}%` }, inner), text);
}

export function badge(state) {
  return el('span', { class: `badge s-${state}` }, state);
}

export function ago(when) {
  const s = (Date.now() - new Date(when).getTime()) / 1000;
  if (!isFinite(s)) return '';
  if (s < 60) return `${Math.max(0, Math.round(s))} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  if (s < 86400) return `${(s / 3600).toFixed(1)} h ago`;
  return `${(s / 86400).toFixed(1)} d ago`;
}

export function bytes(n) {
  if (n == null) return '';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function num(n, digits = 2) {
  return Number(n).toFixed(digits).replace(/\.?0+$/, '');
}
