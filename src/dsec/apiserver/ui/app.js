// The dashboard: log in with an API key, then one page per hash route
// (#/nodes, #/sandboxes?project=&label=&state=&offset=, #/sandbox/ID, #/projects, #/failures).
// The hash holds filters and ids only: the key is in sessionStorage (api.js).

import { get, session } from './api.js';
import { el } from './dom.js';
import * as pages from './pages.js';

const main = document.getElementById('main');
const top = document.getElementById('top');
let current = null;      // the shown page's AbortController and timers
let me = null;           // {project, admin}

function route() {
  const [path, query] = (location.hash.slice(1) || '/nodes').split('?');
  const params = new URLSearchParams(query || '');
  const parts = path.split('/').filter(Boolean);
  if (parts[0] === 'sandbox' && parts[1]) { params.set('id', decodeURIComponent(parts[1])); return ['sandbox', params]; }
  return [pages[parts[0]] && parts[0] !== 'PAGE_SIZE' ? parts[0] : 'nodes', params];
}

export function go(page, params = {}) {
  const q = new URLSearchParams(Object.entries(params).filter(([, v]) => v != null && v !== '' && v !== 0));
  location.hash = `#/${page}${q.toString() ? `?${q}` : ''}`;
}

function stop() {
  if (!current) return;
  current.ctl.abort();
  current.timers.forEach(clearInterval);
  current = null;
}

async function show() {
  stop();
  if (!session.key) return login();
  if (!me) {
    try { me = await whoami(); } catch (e) { session.clear(); return login(e.message); }
  }
  const [page, params] = route();
  top.hidden = false;
  for (const a of top.querySelectorAll('nav a')) a.classList.toggle('active', a.dataset.page === page);
  document.getElementById('who').textContent = `${me.admin ? 'admin' : 'project'}: ${me.project.name} (${me.project.id})`;
  const ctl = new AbortController();
  const state = current = { ctl, timers: [] };
  const every = (ms, fn) => state.timers.push(setInterval(() => {
    if (!document.hidden && !ctl.signal.aborted) fn().catch((e) => console.warn(e));
  }, ms));
  main.replaceChildren(el('p', { class: 'muted' }, 'loading...'));
  try {
    await pages[page]({ main, params, signal: ctl.signal, every, go, admin: me.admin });
  } catch (e) {
    if (!ctl.signal.aborted) main.append(el('p', { class: 'error', id: 'page-error' }, e.message));
  }
}

async function whoami() {
  const projects = (await get('/v1/projects')).projects;     // the caller's project comes first
  return { project: projects[0], admin: projects[0].parent_id == null };
}

function login(message = '') {
  top.hidden = true;
  me = null;
  const form = document.getElementById('login-form').content.cloneNode(true).firstElementChild;
  main.replaceChildren(form);
  form.querySelector('#login-error').textContent = message;
  form.addEventListener('submit', async (ev) => {
    ev.preventDefault();                  // never submitted: the key stays out of URLs and bodies
    const input = form.querySelector('#key');
    session.set(input.value.trim());
    input.value = '';
    try {
      me = await whoami();
    } catch (e) {
      session.clear();
      form.querySelector('#login-error').textContent = e.status === 401 ? 'unknown or revoked API key' : e.message;
      return;
    }
    show();
  });
  form.querySelector('#key').focus();
}

window.addEventListener('hashchange', show);
window.addEventListener('dsec-logout', () => {   // a 401 while logged in: the key was revoked
  if (!me) return;
  session.clear(); stop(); login('the key is no longer valid');
});
document.getElementById('logout').addEventListener('click', () => { session.clear(); stop(); login(); });
show();
