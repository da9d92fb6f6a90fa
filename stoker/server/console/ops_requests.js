// The most recent requests (GET /console/requests: the server keeps the last 500), newest first.
import { format } from './charts.js';
import { field, h, replace } from './dom.js';
import { showRefusal } from './operator.js';

const POLL_MS = 2000;
const COLUMNS = ['Time', 'Status', 'Latency', 'Key', 'Model', 'Path', 'Tokens in/out', 'Finish', 'Error'];

function row(r) {
  const when = r.ts ? new Date(r.ts * 1000).toLocaleTimeString() : '–';
  return h(
    'tr',
    { 'data-request-id': r.request_id },
    h('td', { title: r.request_id }, when),
    h('td', { class: r.status < 400 ? 'status-ok' : 'status-bad' }, String(r.status)),
    h('td', { class: 'num' }, format(r.latency, 'seconds')),
    h('td', {}, r.key_name ?? r.key_id ?? 'no key'),
    h('td', {}, r.model ?? '–'),
    h('td', { class: 'mono' }, `${r.method ?? ''} ${r.path ?? ''}`),
    h('td', { class: 'num' }, `${r.prompt_tokens ?? '–'} / ${r.completion_tokens ?? '–'}`),
    h('td', {}, r.finish_reason ?? '–'),
    h('td', {}, r.error ?? ''),
  );
}

export function mount(root, ctx) {
  const paused = h('input', { type: 'checkbox', id: 'requests-pause' });
  const limit = h('select', { id: 'requests-limit' }, [50, 100, 500].map((n) => h('option', { value: n, selected: n === 100 }, String(n))));
  const status = h('p', { class: 'muted', role: 'status' }, 'Loading…');
  const body = h('tbody');
  replace(
    root,
    h('form', { class: 'inline', 'aria-label': 'Table options' }, field('Show', limit), h('label', { class: 'check', for: 'requests-pause' }, paused, 'Pause updates')),
    status,
    h('div', { class: 'table-wrap' }, h('table', { 'aria-label': 'Recent requests' }, h('thead', {}, h('tr', {}, COLUMNS.map((c) => h('th', { scope: 'col' }, c)))), body)),
  );
  let timer = null;

  async function poll() {
    if (paused.checked) return;
    try {
      const answer = await ctx.api.fetchJSON(`/console/requests?limit=${limit.value}`, { signal: ctx.signal });
      replace(body, answer.data.map(row));
      replace(status, `${answer.data.length} most recent of the last ${answer.size} this server keeps; refreshed every ${POLL_MS / 1000} s.`);
    } catch (err) {
      if (err.name === 'AbortError') return;
      if (err.status === 401 || err.status === 403) {
        clearInterval(timer);
        showRefusal(root, err);
        return;
      }
      replace(status, h('span', { class: 'error' }, err.message));
    }
  }

  limit.addEventListener('change', poll);
  poll();
  timer = setInterval(poll, POLL_MS);
  return () => clearInterval(timer);
}
