// The pages: each renders into `main` from the JSON API and refreshes itself while shown.

import { get, samples } from './api.js';
import { lineChart } from './chart.js';
import { ago, badge, bar, bytes, el, num, table } from './dom.js';
import { UNAVAILABLE, describe, follow, recent } from './events.js';

export const PAGE_SIZE = 50;    // rows of the sandbox table: the DOM stays small at any fleet size
const STATES = ['creating', 'running', 'suspended', 'stopping', 'stopped', 'failed'];

function replace(node, ...kids) { node.replaceChildren(...kids.flat()); }

// -- nodes: pressure, load and sandbox counts by state ----------------------------------
export async function nodes({ main, signal, every }) {
  const body = el('div');
  replace(main, el('h1', {}, 'Nodes'), body);
  async function draw() {
    const list = await get('/v1/nodes', {}, { signal });
    const counts = await Promise.all(list.map((n) => get(`/v1/nodes/${encodeURIComponent(n.node_id)}/metrics`, {},
      { signal, text: true }).then((t) => byState(t, n.node_id)).catch(() => null)));
    replace(body, table(['node', 'health', 'pressure', 'sandboxes', 'by state', 'CPU committed', 'memory committed', 'backends'],
      list.map((n, i) => el('tr', { 'data-node': n.node_id },
        el('td', {}, n.node_id),
        el('td', {}, n.healthy ? el('span', { class: 'badge s-running' }, 'healthy')
          : el('span', { class: 'badge s-failed', title: n.reason || '' }, 'unhealthy')),
        el('td', {}, bar(n.pressure, num(n.pressure))),
        el('td', {}, bar(n.sandboxes / Math.max(n.capacity.max_sandboxes, 1), `${n.sandboxes} / ${n.capacity.max_sandboxes}`)),
        el('td', {}, counts[i] ? Object.entries(counts[i]).map(([s, c]) => el('span', { class: 'chip' }, `${s} ${c}`)) : ''),
        el('td', {}, bar(n.committed_cpu_cores / Math.max(n.capacity.cpu_cores, 1e-9),
          `${num(n.committed_cpu_cores)} / ${num(n.capacity.cpu_cores)} cores`)),
        el('td', {}, bar(n.committed_memory_mb / Math.max(n.capacity.memory_mb, 1),
          `${bytes(n.committed_memory_mb * 1048576)} / ${bytes(n.capacity.memory_mb * 1048576)}`)),
        el('td', {}, n.backends.join(', '))))),
    el('p', { class: 'muted' }, 'pressure: the highest PSI avg10 over its admission limit (1: the node refuses new sandboxes)'));
  }
  await draw();
  every(5000, draw);
}

function byState(text, node) {
  const out = {};
  for (const s of samples(text, 'dsec_sandboxes')) {
    if (s.labels.node !== node || !s.value) continue;
    const key = s.labels.parked ? `${s.labels.state} (${s.labels.parked})` : s.labels.state;
    out[key] = (out[key] || 0) + s.value;
  }
  return out;
}

// -- sandboxes: filtered, one page at a time (the server pages: limit/offset) -------------
export async function sandboxes({ main, params, signal, every, go }) {
  const q = { project: params.get('project') || '', label: params.get('label') || '',
    state: params.get('state') || '', offset: Math.max(0, Number(params.get('offset')) || 0) };
  const projectSelect = el('select', { name: 'project' }, el('option', { value: '' }, 'all'),
    q.project ? el('option', { value: q.project, selected: true }, q.project) : null);
  const form = el('form', { class: 'filters', id: 'filters', method: 'post' },
    el('label', {}, 'project', projectSelect),
    el('label', {}, 'labels (key=value, comma-separated)', el('input', { name: 'label', value: q.label, placeholder: 'job=run-17' })),
    el('label', {}, 'state', el('select', { name: 'state' }, el('option', { value: '' }, 'live (all but ended)'),
      STATES.map((s) => el('option', { value: s, selected: s === q.state }, s)))),
    el('button', { type: 'submit' }, 'Apply'));
  form.addEventListener('submit', (ev) => {
    ev.preventDefault();
    const f = new FormData(form);
    go('sandboxes', { project: f.get('project'), label: f.get('label').trim(), state: f.get('state') });
  });
  const status = el('span', { class: 'muted', id: 'count' });
  const prev = el('button', { type: 'button', id: 'prev' }, 'Previous');
  const next = el('button', { type: 'button', id: 'next' }, 'Next');
  const tbody = el('tbody', { id: 'rows' });
  const error = el('p', { class: 'error' });
  replace(main, el('h1', {}, 'Sandboxes'), form, error, el('div', { class: 'pager' }, prev, next, status),
    el('table', { id: 'sandboxes' }, el('thead', {}, el('tr', {}, ['id', 'project', 'state', 'backend', 'image',
      'CPU', 'memory', 'node', 'created', 'labels'].map((h) => el('th', {}, h)))), tbody));
  const labels = q.label.split(',').map((s) => s.trim()).filter(Boolean);
  async function draw() {
    const page = await get('/v1/sandboxes', { project: q.project, label: labels, state: q.state,
      limit: PAGE_SIZE, offset: q.offset }, { signal });
    replace(tbody, page.sandboxes.map((s) => el('tr', {},
      el('td', {}, el('a', { href: `#/sandbox/${encodeURIComponent(s.id)}` }, s.id)),
      el('td', {}, s.project), el('td', {}, badge(s.state)), el('td', {}, s.backend), el('td', {}, s.image),
      el('td', {}, num(s.cpu_cores, 3)), el('td', {}, `${s.memory_mb} MiB`), el('td', {}, s.node),
      el('td', { title: s.created_at }, ago(s.created_at)),
      el('td', { class: 'wrap' }, Object.entries(s.labels).map(([k, v]) => el('span', { class: 'chip' }, `${k}=${v}`))))));
    const shown = page.sandboxes.length;
    status.textContent = page.total ? `${q.offset + 1}-${q.offset + shown} of ${page.total}` : 'no sandboxes match';
    if (page.unreachable_nodes.length) status.textContent += ` (nodes not answering, shown as last known: ${page.unreachable_nodes.join(', ')})`;
    prev.disabled = q.offset === 0;
    next.disabled = page.next_offset == null;
    performance.mark('dsec-rows');     // benchmarks/ui_first_paint.py reads it
  }
  const move = (offset) => go('sandboxes', { project: q.project, label: q.label, state: q.state, offset });
  prev.addEventListener('click', () => move(Math.max(0, q.offset - PAGE_SIZE)));
  next.addEventListener('click', () => move(q.offset + PAGE_SIZE));
  const fillProjects = get('/v1/projects', {}, { signal }).then(({ projects }) => replace(projectSelect,
    el('option', { value: '' }, 'all'),
    projects.map((p) => el('option', { value: p.id, selected: p.id === q.project }, `${p.name} (${p.id})`))));
  try { await Promise.all([draw(), fillProjects]); } catch (e) { error.textContent = e.message; throw e; }   // at once: first paint
  every(5000, draw);
}

// -- one sandbox: its record, live usage charts, its events -------------------------------
export async function sandbox({ main, params, signal, every }) {
  const id = params.get('id');
  const info = el('dl', { class: 'info', id: 'info' });
  const canvases = ['cpu', 'memory', 'network'].map((n) => el('canvas', { id: `chart-${n}` }));
  const evBox = el('div', { class: 'events', id: 'events' }, el('span', { class: 'muted' }, 'waiting for events...'));
  replace(main, el('h1', {}, 'Sandbox ', el('span', { id: 'sandbox-id' }, id)), el('div', { class: 'card' }, info),
    el('h2', {}, 'Usage (live, every 5 s)'), el('div', { class: 'charts card' }, canvases.map((c) => el('div', {}, c))),
    el('h2', {}, 'Events'), el('div', { class: 'card' }, evBox));
  async function drawInfo() {
    const s = await get(`/v1/sandboxes/${encodeURIComponent(id)}`, {}, { signal });
    const row = (k, v) => [el('dt', {}, k), el('dd', {}, v)];
    replace(info, row('state', badge(s.state)), row('project', s.project), row('node', s.node), row('backend', s.backend),
      row('image', s.image), row('size', `${num(s.cpu_cores, 3)} cores, ${s.memory_mb} MiB`),
      row('created', `${s.created_at} (${ago(s.created_at)})`), row('last active', ago(s.last_active_at)),
      row('expires', s.expires_at || 'idle TTL only'), row('labels', Object.entries(s.labels).map(([k, v]) => el('span', { class: 'chip' }, `${k}=${v}`))),
      s.error ? row('error', el('span', { class: 'error' }, s.error)) : []);
  }
  async function drawUsage() {
    const since = Date.now() / 1000 - 900;
    const u = await get(`/v1/sandboxes/${encodeURIComponent(id)}/metrics`, { start: since.toFixed(0) }, { signal });
    const pts = (f) => u.samples.map((s) => ({ t: s.timestamp, v: f(s) }));
    const last = u.samples[u.samples.length - 1];
    lineChart(canvases[0], { title: 'CPU %', max: 100, fmt: (v) => `${num(v, 1)}%`,
      series: [{ name: 'used', color: '#2f6fed', points: pts((s) => s.cpu_used_pct) }] });
    lineChart(canvases[1], { title: 'memory', max: last ? last.mem_total : 0, fmt: bytes,
      series: [{ name: 'used', color: '#12805c', points: pts((s) => s.mem_used) },
        { name: 'cache', color: '#98a2b3', points: pts((s) => s.mem_cache) }] });
    const rate = (key) => u.samples.slice(1).map((s, i) => ({ t: s.timestamp,
      v: Math.max(0, ((s[key] || 0) - (u.samples[i][key] || 0)) / Math.max(s.timestamp - u.samples[i].timestamp, 1e-3)) }));
    lineChart(canvases[2], { title: 'network /s', fmt: bytes,
      series: [{ name: 'rx', color: '#b54708', points: rate('net_rx_bytes') }, { name: 'tx', color: '#7a5af8', points: rate('net_tx_bytes') }] });
  }
  await drawInfo();
  await drawUsage();
  every(5000, () => Promise.all([drawInfo(), drawUsage()]));
  const seen = [];
  follow({ sandbox_id: id, follow: true }, (e) => {    // its past events, then new ones as they come
    const d = describe(e);
    if (d.sandbox && d.sandbox !== id) return;
    if (!seen.length) evBox.replaceChildren();
    seen.push(d);
    const why = [d.reason && `reason=${d.reason}`, d.infrastructure === true && '(infrastructure)', d.message].filter(Boolean);
    evBox.prepend(el('div', { class: 'event' }, `${d.when}  ${d.type}  ${why.join('  ')}`));
    while (evBox.childElementCount > 200) evBox.lastElementChild.remove();
  }, signal).then((r) => {
    if (r === UNAVAILABLE) evBox.replaceChildren(el('span', { class: 'muted', id: 'events-unavailable' }, 'events not available on this server'));
    else if (!seen.length) evBox.replaceChildren(el('span', { class: 'muted' }, 'no events'));
  }).catch((e) => { if (!signal.aborted) evBox.replaceChildren(el('span', { class: 'error' }, e.message)); });
}

// -- projects: quotas and what they hold --------------------------------------------------
export async function projects({ main, signal, every }) {
  const body = el('div');
  replace(main, el('h1', {}, 'Projects'), body);
  async function draw() {
    const list = (await get('/v1/projects', {}, { signal })).projects;
    const quotas = await Promise.all(list.map((p) => get(`/v1/projects/${encodeURIComponent(p.id)}/quota`, {}, { signal })
      .catch(() => null)));
    const names = Object.fromEntries(list.map((p) => [p.id, p.name]));
    replace(body, table(['project', 'id', 'parent', 'sandboxes', 'CPU cores', 'memory', ''],
      list.map((p, i) => {
        const q = quotas[i], u = q ? q.used : { sandboxes: 0, cpu_cores: 0, memory_mb: 0 };
        return el('tr', { 'data-project': p.id },
          el('td', {}, p.name), el('td', {}, p.id), el('td', {}, p.parent_id ? names[p.parent_id] || p.parent_id : '(root)'),
          el('td', {}, bar(u.sandboxes / Math.max(p.max_sandboxes, 1), `${u.sandboxes} / ${p.max_sandboxes}`)),
          el('td', {}, bar(u.cpu_cores / Math.max(p.max_cpu_cores, 1e-9), `${num(u.cpu_cores)} / ${num(p.max_cpu_cores)}`)),
          el('td', {}, bar(u.memory_mb / Math.max(p.max_memory_mb, 1), `${bytes(u.memory_mb * 1048576)} / ${bytes(p.max_memory_mb * 1048576)}`)),
          el('td', {}, el('a', { href: `#/sandboxes?project=${encodeURIComponent(p.id)}` }, 'sandboxes')));
      })),
    el('p', { class: 'muted' }, 'used: what the project and its sub-projects hold now, on every node'));
  }
  await draw();
  every(10000, draw);
}

// -- failures: by reason -----------------------------------------------------------------
export async function failures({ main, signal, every, admin }) {
  const failed = el('div', { id: 'failed' }), refused = el('div', { id: 'refused' }), ended = el('div', { id: 'ended' });
  replace(main, el('h1', {}, 'Recent failures'),
    el('div', { class: 'split' },
      el('div', { class: 'card' }, el('h2', {}, 'Failed sandboxes by reason'), failed),
      el('div', { class: 'card' }, el('h2', {}, 'Refused creations by reason (since the server started)'), refused)),
    el('div', { class: 'card' }, el('h2', {}, 'Ended sandboxes by reason, last hour (events)'), ended));
  async function draw() {
    const page = await get('/v1/sandboxes', { state: 'failed', limit: 1000 }, { signal });
    const groups = new Map();
    for (const s of page.sandboxes) {
      const reason = (s.error || 'no reason given').replace(/[0-9a-f]{8,}|\d+(\.\d+)?/g, 'N').slice(0, 120);
      const g = groups.get(reason) || { n: 0, last: s };
      g.n++;
      if (s.created_at > g.last.created_at) g.last = s;
      groups.set(reason, g);
    }
    replace(failed, groups.size ? table(['reason', 'sandboxes', 'latest'], [...groups].sort((a, b) => b[1].n - a[1].n)
      .map(([reason, g]) => el('tr', {}, el('td', { class: 'wrap' }, reason), el('td', {}, String(g.n)),
        el('td', {}, el('a', { href: `#/sandbox/${encodeURIComponent(g.last.id)}` }, g.last.id)))))
      : el('p', { class: 'muted' }, 'no failed sandboxes'));
    const text = await get(admin ? '/metrics' : '/v1/metrics', {}, { signal, text: true });
    const rows = samples(text, 'dsec_admission_refusals_total').filter((s) => s.value > 0)
      .concat(samples(text, 'dsec_sandbox_creates_total').filter((s) => s.labels.outcome === 'failed' && s.value > 0)
        .map((s) => ({ labels: { reason: `create failed (${s.labels.project}, ${s.labels.backend})` }, value: s.value })));
    replace(refused, rows.length ? table(['reason', 'count'], rows.sort((a, b) => b.value - a.value)
      .map((s) => el('tr', {}, el('td', {}, s.labels.reason), el('td', {}, String(s.value)))))
      : el('p', { class: 'muted' }, admin ? 'none' : 'none of your project\'s (node-wide refusals: admins)'));
  }
  await draw();
  every(10000, draw);
  // ended sandboxes of the last hour by reason, infrastructure ones marked (read once per visit)
  const reasons = new Map();
  const since = Date.now() - 3600e3;
  recent({}, (events) => {
    for (const e of events) {
      const d = describe(e);
      if (d.type !== 'ended' || (d.at && d.at.getTime() < since)) continue;
      const key = `${d.reason || '(none)'}${d.infrastructure === true ? ' (infrastructure)' : ''}`;
      reasons.set(key, (reasons.get(key) || 0) + 1);
    }
  }, signal).catch(() => null).then((r) => {
    if (r === UNAVAILABLE) ended.replaceChildren(el('span', { class: 'muted', id: 'events-unavailable' }, 'events not available on this server'));
    else ended.replaceChildren(reasons.size ? table(['reason', 'sandboxes'], [...reasons].sort((a, b) => b[1] - a[1])
      .map(([k, v]) => el('tr', {}, el('td', {}, k), el('td', {}, String(v)))))
      : el('p', { class: 'muted' }, 'no sandbox ended in the last hour'));
  });
}
