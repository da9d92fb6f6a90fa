// Keys: create (the secret shown once), list, edit limits and budgets, revoke;
// usage per key over time from GET /console/usage (the ledger).
import { chart } from './charts.js';
import { field, h, replace } from './dom.js';
import { showRefusal } from './operator.js';

const LIMITS = [
  ['rpm', 'Requests per minute'],
  ['tpm', 'Tokens per minute'],
  ['max_concurrent', 'Concurrent requests'],
  ['budget_tokens', 'Token budget'],
];

function numberField(name, label, value) {
  return field(label, h('input', { name, type: 'number', min: 1, step: 1, inputmode: 'numeric', value: value ?? '', placeholder: 'no limit' }));
}

function selectField(name, label, options, value) {
  return field(label, h('select', { name }, options.map((o) => h('option', { value: o, selected: o === value }, o))));
}

/** The form's fields as a key body: empty number fields are null (no limit). */
function readForm(form, { forEdit }) {
  const data = new FormData(form);
  const body = {};
  const name = String(data.get('name') ?? '').trim();
  if (!forEdit || name) body.name = name;
  for (const [field] of LIMITS) {
    const raw = String(data.get(field) ?? '').trim();
    if (raw) body[field] = Number(raw);
    else if (forEdit) body[field] = null;
  }
  body.budget_period = data.get('budget_period');
  body.priority = data.get('priority');
  const models = String(data.get('models') ?? '').split(',').map((m) => m.trim()).filter(Boolean);
  if (models.length) body.models = models;
  else if (forEdit) body.models = null;
  if (!forEdit && data.get('admin')) body.admin = true;
  return body;
}

function keyFields(key = {}) {
  return [
    field('Name', h('input', { name: 'name', required: !key.id, maxlength: 200, value: key.name ?? '', autocomplete: 'off' })),
    LIMITS.map(([field, label]) => numberField(field, label, key[field])),
    selectField('budget_period', 'Budget period', ['month', 'day'], key.budget_period ?? 'month'),
    selectField('priority', 'Priority', ['interactive', 'batch'], key.priority ?? 'interactive'),
    field('Models (comma-separated; empty: all)', h('input', { name: 'models', value: (key.models ?? []).join(', ') })),
  ];
}

export function mount(root, ctx) {
  const api = ctx.api;
  const message = h('p', { role: 'status', 'aria-live': 'polite' });
  const secretBox = h('div', { 'aria-live': 'polite' });
  const tableSlot = h('div', { class: 'table-wrap' }, h('p', { class: 'muted' }, 'Loading keys…'));
  const usageSlot = h('div');
  const createForm = h(
    'form',
    { class: 'inline', 'aria-label': 'Create a key' },
    keyFields(),
    h('label', { class: 'check' }, h('input', { type: 'checkbox', name: 'admin' }), 'Admin (every scope)'),
    h('button', { type: 'submit', class: 'primary' }, 'Create key'),
  );
  replace(root, h('h2', {}, 'Create a key'), createForm, secretBox, message, h('h2', {}, 'Keys'), tableSlot, h('h2', {}, 'Usage over time'), usageSlot);

  function say(text, kind = 'info') {
    message.className = kind === 'error' ? 'error' : 'muted';
    replace(message, text);
  }

  function failed(err) {
    if (err.status === 401 || err.status === 403) showRefusal(root, err);
    else if (err.name !== 'AbortError') say(err.message, 'error');
  }

  createForm.addEventListener('submit', async (event) => {
    event.preventDefault();
    try {
      const created = await api.fetchJSON('/admin/keys', { method: 'POST', body: readForm(createForm, { forEdit: false }) });
      createForm.reset();
      const secret = h('code', { class: 'secret', 'data-secret': '' }, created.secret);
      replace(
        secretBox,
        h(
          'div',
          { class: 'card', role: 'alert' },
          h('p', {}, `Key “${created.name}” created. Copy its secret now: it is shown once and never again.`),
          secret,
          h('p', {}, h('button', { type: 'button', onclick: () => navigator.clipboard?.writeText(created.secret).then(() => say('Secret copied.')) }, 'Copy secret'),
            ' ', h('button', { type: 'button', onclick: () => replace(secretBox) }, 'Done, hide it')),
        ),
      );
      await refresh();
    } catch (err) {
      failed(err);
    }
  });

  function limitsText(key) {
    const parts = LIMITS.filter(([f]) => key[f] !== null && key[f] !== undefined && f !== 'budget_tokens').map(([f]) => `${f} ${key[f]}`);
    return parts.length ? parts.join(', ') : 'none';
  }

  function budgetCell(key, usage) {
    if (!key.budget_tokens) return 'no budget';
    const spent = usage?.used_this_period;
    if (spent === undefined) return `${key.budget_tokens} tokens per ${key.budget_period}`; // revoked: not counted
    return h(
      'span',
      {},
      h('meter', { min: 0, max: key.budget_tokens, value: Math.min(spent, key.budget_tokens), 'aria-label': `Budget used by ${key.name}` }),
      ` ${spent} / ${key.budget_tokens} tokens this ${key.budget_period}`,
    );
  }

  function editRow(key, columns) {
    const form = h(
      'form',
      { class: 'inline', 'aria-label': `Edit key ${key.name}` },
      keyFields(key),
      h('button', { type: 'submit', class: 'primary' }, 'Save'),
      h('button', { type: 'button', onclick: () => refresh() }, 'Cancel'),
    );
    form.addEventListener('submit', async (event) => {
      event.preventDefault();
      try {
        await api.fetchJSON(`/admin/keys/${encodeURIComponent(key.id)}`, { method: 'PATCH', body: readForm(form, { forEdit: true }) });
        say(`Key “${key.name}” saved.`);
        await refresh();
      } catch (err) {
        failed(err);
      }
    });
    return h('tr', { class: 'edit-row' }, h('td', { colspan: columns }, form));
  }

  function row(key, usage) {
    const actions = h('td');
    const tr = h(
      'tr',
      { 'data-key-id': key.id },
      h('td', {}, key.name),
      h('td', { class: 'mono' }, key.prefix),
      h('td', { class: key.status === 'active' ? 'status-ok' : 'status-bad' }, key.status),
      h('td', {}, key.scopes.join(', ')),
      h('td', {}, limitsText(key)),
      h('td', {}, budgetCell(key, usage)),
      actions,
    );
    if (key.status !== 'revoked') {
      const revoke = h('button', { type: 'button', class: 'danger', 'aria-label': `Revoke ${key.name}` }, 'Revoke');
      revoke.addEventListener('click', async () => {
        if (revoke.dataset.armed === undefined) {
          revoke.dataset.armed = '';
          revoke.textContent = 'Confirm revoke';
          revoke.setAttribute('aria-label', `Confirm: revoke ${key.name}`);
          return;
        }
        try {
          await api.fetchJSON(`/admin/keys/${encodeURIComponent(key.id)}`, { method: 'DELETE' });
          say(`Key “${key.name}” revoked.`);
          await refresh();
        } catch (err) {
          failed(err);
        }
      });
      const edit = h('button', { type: 'button', 'aria-label': `Edit ${key.name}` }, 'Edit');
      edit.addEventListener('click', () => tr.after(editRow(key, 7)));
      actions.append(edit, ' ', revoke);
    }
    return tr;
  }

  let usageKey = '';
  let usageBucket = 'hour';

  function renderUsage(keys, report) {
    const active = report.keys.filter((k) => k.series.length);
    const picker = h('select', { id: 'usage-key' }, h('option', { value: '' }, 'Top keys'), keys.map((k) => h('option', { value: k.id, selected: k.id === usageKey }, k.name)));
    const bucket = h('select', { id: 'usage-bucket' }, ['hour', 'day'].map((b) => h('option', { value: b, selected: b === usageBucket }, b === 'hour' ? 'per hour, 24 h' : 'per day, 30 days')));
    picker.addEventListener('change', () => { usageKey = picker.value; refresh(); });
    bucket.addEventListener('change', () => { usageBucket = bucket.value; refresh(); });
    const shown = (usageKey ? active.filter((k) => k.key_id === usageKey) : active).slice(0, 4);
    const controls = h(
      'form',
      { class: 'inline', 'aria-label': 'Usage view' },
      field('Key', picker),
      field('Buckets', bucket),
    );
    if (!shown.length) {
      replace(usageSlot, controls, h('p', { class: 'muted' }, 'No usage recorded in this time.'));
      return;
    }
    const span = report.bucket_seconds * (usageBucket === 'hour' ? 24 : 30);
    const c = chart({ title: `Tokens per ${usageBucket} (prompt + completion)`, kind: 'count', series: shown.map((k) => k.key_name ?? k.key_id), seconds: span });
    // Every bucket of the window, 0 where a key used nothing: a line from what happened, not between gaps.
    const times = [];
    for (let t = report.start; t <= Date.now() / 1000; t += report.bucket_seconds) times.push(t);
    const lookup = shown.map((k) => new Map(k.series.map((p) => [p.t, p.prompt_tokens + p.completion_tokens])));
    replace(usageSlot, controls, c.element);
    c.update(times.map((t) => [t, lookup.map((m) => m.get(t) ?? 0)]));
    const total = shown.map((k) => {
      const requests = k.series.reduce((a, p) => a + p.requests, 0);
      return `${k.key_name ?? k.key_id}: ${requests} request${requests === 1 ? '' : 's'}`;
    });
    usageSlot.append(h('p', { class: 'muted' }, total.join('; ')));
  }

  async function refresh() {
    try {
      const query = `bucket=${usageBucket}&buckets=${usageBucket === 'hour' ? 24 : 30}${usageKey ? `&key_id=${encodeURIComponent(usageKey)}` : ''}`;
      const [list, report] = await Promise.all([
        api.fetchJSON('/admin/keys', { signal: ctx.signal }),
        api.fetchJSON(`/console/usage?${query}`, { signal: ctx.signal }),
      ]);
      // Budgets first: they count the whole period, also before the chart's window.
      const usage = new Map([...report.keys, ...report.budgets].map((k) => [k.key_id, k]));
      const keys = list.data.slice().sort((a, b) => (a.status === 'revoked') - (b.status === 'revoked') || b.created_at - a.created_at);
      replace(
        tableSlot,
        h(
          'table',
          { 'aria-label': 'API keys' },
          h('thead', {}, h('tr', {}, ['Name', 'Prefix', 'Status', 'Scopes', 'Limits', 'Budget', 'Actions'].map((c) => h('th', { scope: 'col' }, c)))),
          h('tbody', {}, keys.map((k) => row(k, usage.get(k.id)))),
        ),
      );
      renderUsage(keys, report);
    } catch (err) {
      failed(err);
    }
  }

  ctx.onReconnect(refresh);
  refresh();
  return undefined;
}
