/*
 * The console's shell: the key form, the "server unreachable" banner and hash
 * routing to the views. No build step: plain ES modules served from /ui/.
 *
 * A view is a module exporting
 *     mount(root, ctx) -> (unmount function | undefined), sync or async
 * It draws into root (an empty <section>) and stops its timers and requests
 * when ctx.signal aborts (the user went to another page) or in its unmount.
 *
 * ctx holds:
 *   api      api.js's client: api.fetchJSON(path, {method, body, signal}),
 *            api.stream(path, body, onEvent, {signal}), api.key(), api.headers().
 *            Errors are ApiError {status, code, message}: the message is meant
 *            for people (status 0: the server cannot be reached).
 *   route    {path: 'chat' | 'ops/live' | ..., page: the part after 'ops/',
 *            params: URLSearchParams of the part after '?' in the hash}
 *   signal   AbortSignal, aborted when the view is left
 *   notify(message, kind)  one line in the status area ('info' | 'error')
 *   onReconnect(fn)        fn() runs when the server answers again after the
 *                          banner said it could not be reached
 *   onKeyChange(fn)        fn() runs after the user enters or forgets a key;
 *                          a view that registers none is mounted again instead
 * Views build DOM with dom.js's h() (text nodes only, never innerHTML).
 */
import { createApi } from './api.js';
import { h, replace } from './dom.js';

const VIEWS = {
  chat: () => import('./playground.js'),
  ops: () => import('./operator.js'),
};
const DEFAULT_ROUTE = 'chat';
const HEALTH_POLL_MS = 1000;

const banner = document.getElementById('banner');
const keyStatus = document.getElementById('key-status');
const view = document.getElementById('view');
const listeners = { reconnect: new Set(), key: new Set() };
let healthTimer = null;

const api = createApi({ onUnreachable: showUnreachable, onReachable: serverBack });

function showUnreachable() {
  banner.hidden = false;
  replace(banner, 'The server cannot be reached: it may be restarting. This page retries by itself and recovers when it is back.');
  if (healthTimer === null) healthTimer = setInterval(pollHealth, HEALTH_POLL_MS);
}

async function pollHealth() {
  if (await api.alive()) serverBack();
}

function serverBack() {
  if (healthTimer === null && banner.hidden) return;
  clearInterval(healthTimer);
  healthTimer = null;
  banner.hidden = true;
  replace(banner);
  notify('The server is back.');
  for (const fn of listeners.reconnect) fn();
}

function notify(message, kind = 'info') {
  keyStatus.className = `key-status ${kind}`;
  replace(keyStatus, message);
}

function parseRoute() {
  const hash = location.hash.replace(/^#\/?/, '') || DEFAULT_ROUTE;
  const [path, query = ''] = hash.split('?');
  const top = path.split('/')[0];
  return { path, top, page: path.startsWith('ops/') ? path.slice(4) : '', params: new URLSearchParams(query) };
}

let current = null; // {controller, unmount}

async function route(event) {
  if (current) {
    current.controller.abort();
    if (typeof current.unmount === 'function') current.unmount();
    current = null;
  }
  listeners.reconnect.clear();
  listeners.key.clear();
  const r = parseRoute();
  for (const link of document.querySelectorAll('nav a')) {
    if (link.dataset.route === r.path) link.setAttribute('aria-current', 'page');
    else link.removeAttribute('aria-current');
  }
  const controller = new AbortController();
  const root = h('section', { class: `view view-${r.top}`, 'aria-live': 'off' });
  replace(view, root);
  current = { controller, unmount: null };
  const load = VIEWS[r.top];
  if (!load) {
    replace(root, h('p', { class: 'error', role: 'alert' }, `No page '${r.path}'. `, h('a', { href: '#/chat' }, 'Go to the chat.')));
    return;
  }
  let module;
  try {
    module = await load();
  } catch (err) {
    replace(root, h('p', { class: 'error', role: 'alert' }, `This page could not be loaded: ${err.message}`));
    return;
  }
  if (controller.signal.aborted) return;
  const ctx = {
    api,
    route: { path: r.path, page: r.page, params: r.params },
    signal: controller.signal,
    notify,
    onReconnect: (fn) => listeners.reconnect.add(fn),
    onKeyChange: (fn) => listeners.key.add(fn),
  };
  try {
    current.unmount = await module.mount(root, ctx);
  } catch (err) {
    replace(root, h('p', { class: 'error', role: 'alert' }, err.message || String(err)));
  }
  // A page changed by a link: focus goes to it, so keyboard and screen-reader users land in the new page.
  if (event?.type === 'hashchange') view.focus({ preventScroll: true });
}

function setUpKeyForm() {
  const form = document.getElementById('key-form');
  const input = document.getElementById('key-input');
  const remember = document.getElementById('key-remember');
  // A key typed before this module ran (a slow load) is kept, not overwritten by the stored one.
  if (!input.value) input.value = api.key();
  remember.checked = remember.checked || api.remembered();
  form.addEventListener('submit', (event) => {
    event.preventDefault();
    api.setKey(input.value.trim(), remember.checked);
    notify(input.value.trim() ? 'Key saved for this ' + (remember.checked ? 'device.' : 'tab.') : 'No key: open mode.');
    keyChanged();
  });
  document.getElementById('key-forget').addEventListener('click', () => {
    api.forgetKey();
    input.value = '';
    remember.checked = false;
    notify('Key forgotten.');
    keyChanged();
  });
}

function keyChanged() {
  if (listeners.key.size === 0) route();
  else for (const fn of listeners.key) fn();
}

setUpKeyForm();
window.addEventListener('hashchange', route);
route();
