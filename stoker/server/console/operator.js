// The operator pages (#/ops/live, models, keys, requests): admin scope, enforced
// by the server; a refusal is shown as a message, never as an empty page.
import { h, replace } from './dom.js';

const PAGES = {
  live: { title: 'Live', load: () => import('./ops_live.js') },
  models: { title: 'Models', load: () => import('./ops_models.js') },
  keys: { title: 'Keys', load: () => import('./ops_keys.js') },
  requests: { title: 'Recent requests', load: () => import('./ops_requests.js') },
};

/** The message for a refused operator call: what went wrong and what to do. */
export function refusal(error) {
  if (error.status === 401) return error.message;
  if (error.status === 403) {
    return `These pages need an admin key: the server refused this one. ${error.message}`;
  }
  return error.message;
}

/** Show err in root as a clear, focused message (never a blank page). */
export function showRefusal(root, err) {
  replace(root, h('div', { class: 'refused', role: 'alert' }, h('p', {}, refusal(err))));
}

export async function mount(root, ctx) {
  const page = PAGES[ctx.route.page];
  if (!page) {
    replace(root, h('p', { class: 'error', role: 'alert' }, `No operator page '${ctx.route.page}'.`));
    return undefined;
  }
  document.title = `${page.title} · stoker console`;
  const module = await page.load();
  const body = h('div');
  replace(root, h('h1', {}, page.title), body);
  return module.mount(body, ctx);
}
