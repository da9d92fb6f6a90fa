// Models through the existing /admin/models API: load (a new model, a swap, or a
// canary), canary share, promote, roll back, unload; each version's status and digest.
import { format } from './charts.js';
import { field, h, replace } from './dom.js';
import { showRefusal } from './operator.js';

function versionRow(role, v) {
  if (!v) return null;
  return h(
    'tr',
    { 'data-version': v.version },
    h('td', {}, role),
    h('td', { class: 'mono' }, v.version),
    h('td', { class: v.ready ? 'status-ok' : 'status-bad' }, v.status + (v.sleeping ? ' (asleep)' : '')),
    h('td', { class: 'mono', title: v.digest ?? '' }, v.digest ? `${v.digest.slice(0, 19)}…` : '–'),
    h('td', { class: 'mono' }, v.path),
    h('td', { class: 'num' }, String(v.in_flight)),
    h('td', { class: 'num' }, v.memory_bytes ? `${format(v.memory_bytes / 2 ** 20, 'count')} MiB` : '–'),
    h('td', {}, v.error ?? ''),
  );
}

export function mount(root, ctx) {
  const api = ctx.api;
  const message = h('p', { role: 'status', 'aria-live': 'polite' });
  const list = h('div', {}, h('p', { class: 'muted' }, 'Loading models…'));
  const loadForm = h(
    'form',
    { class: 'inline', 'aria-label': 'Load a model' },
    field('Name', h('input', { name: 'name', required: true, maxlength: 128, autocomplete: 'off' })),
    field('Path on the server', h('input', { name: 'path', required: true, maxlength: 4096, size: 40 })),
    field('Digest (optional)', h('input', { name: 'digest', placeholder: 'sha256:…', pattern: 'sha256:[0-9a-fA-F]{64}', size: 24 })),
    field('Canary % (optional)', h('input', { name: 'canary_percent', type: 'number', min: 0, max: 100, step: 'any' })),
    h('button', { type: 'submit', class: 'primary' }, 'Load'),
  );
  replace(
    root,
    h('p', { class: 'muted' }, 'A name already served gets a new version: a swap, or a canary given a share of requests. Paths load only from the server\'s --model-root folders.'),
    loadForm,
    message,
    h('h2', {}, 'Served'),
    h('p', {}, h('button', { type: 'button', onclick: () => refresh() }, 'Refresh')),
    list,
  );

  function say(text, kind = 'info') {
    message.className = kind === 'error' ? 'error' : 'muted';
    replace(message, text);
  }

  async function act(label, path, options) {
    say(`${label}…`);
    try {
      await api.fetchJSON(path, options);
      say(`${label}: done.`);
    } catch (err) {
      if (err.status === 401 || err.status === 403) return showRefusal(root, err);
      say(`${label}: ${err.message}`, 'error');
    }
    return refresh();
  }

  loadForm.addEventListener('submit', async (event) => {
    event.preventDefault();
    const data = new FormData(loadForm);
    const body = { name: String(data.get('name')).trim(), path: String(data.get('path')).trim() };
    if (String(data.get('digest')).trim()) body.digest = String(data.get('digest')).trim();
    if (String(data.get('canary_percent')).trim()) body.canary_percent = Number(data.get('canary_percent'));
    const button = loadForm.querySelector('button');
    button.disabled = true;
    await act(`Loading ${body.name}`, '/admin/models', { method: 'POST', body });
    button.disabled = false;
  });

  function modelCard(m) {
    const name = encodeURIComponent(m.name).replace(/%2F/g, '/');
    const actions = h('div', { class: 'inline' });
    if (m.canary) {
      const percent = h('input', { type: 'number', min: 0, max: 100, step: 'any', value: m.canary_percent });
      const share = h('form', { class: 'inline', 'aria-label': `Canary share of ${m.name}` }, field('Canary %', percent), h('button', { type: 'submit' }, 'Set share'));
      share.addEventListener('submit', (event) => {
        event.preventDefault();
        act(`Canary share of ${m.name}`, `/admin/models/${name}/canary`, { method: 'PUT', body: { percent: Number(percent.value) } });
      });
      actions.append(
        share,
        h('button', { type: 'button', onclick: () => act(`Promoting ${m.name}`, `/admin/models/${name}/promote`, { method: 'POST' }) }, 'Promote canary'),
        h('button', { type: 'button', onclick: () => act(`Rolling back ${m.name}`, `/admin/models/${name}/rollback`, { method: 'POST' }) }, 'Roll back canary'),
      );
    }
    const unload = h('button', { type: 'button', class: 'danger', 'aria-label': `Unload ${m.name}` }, 'Unload');
    unload.addEventListener('click', () => {
      if (unload.dataset.armed === undefined) {
        unload.dataset.armed = '';
        unload.textContent = 'Confirm unload';
        return;
      }
      act(`Unloading ${m.name}`, `/admin/models/${name}`, { method: 'DELETE' });
    });
    actions.append(unload);
    return h(
      'section',
      { class: 'card', 'aria-label': `Model ${m.name}`, 'data-model': m.name },
      h('h3', {}, m.name, m.canary ? ` — canary at ${m.canary_percent}%` : ''),
      h(
        'div',
        { class: 'table-wrap' },
        h(
          'table',
          {},
          h('thead', {}, h('tr', {}, ['Role', 'Version', 'Status', 'Digest', 'Path', 'In flight', 'Memory', 'Error'].map((c) => h('th', { scope: 'col' }, c)))),
          h('tbody', {}, versionRow('stable', m.stable), versionRow('canary', m.canary), versionRow('loading', m.loading)),
        ),
      ),
      m.fallbacks.length ? h('p', { class: 'muted' }, `Falls back to ${m.fallbacks.join(', ')}`) : null,
      actions,
    );
  }

  async function refresh() {
    try {
      const answer = await api.fetchJSON('/admin/models', { signal: ctx.signal });
      const retiring = answer.retiring.length
        ? h('p', { class: 'muted' }, `Draining: ${answer.retiring.map((v) => `${v.name} ${v.version}`).join(', ')}`)
        : null;
      replace(list, answer.data.map(modelCard), retiring);
    } catch (err) {
      if (err.status === 401 || err.status === 403) showRefusal(root, err);
      else if (err.name !== 'AbortError') replace(list, h('p', { class: 'error', role: 'alert' }, err.message));
    }
  }

  ctx.onReconnect(refresh);
  refresh();
  return undefined;
}
