// Live figures per model from GET /console/live, polled every POLL_MS; the
// server keeps the last five minutes, so the charts fill at once.
import { chart, format } from './charts.js';
import { h, replace } from './dom.js';
import { showRefusal } from './operator.js';

const POLL_MS = 1500;

function modelPanel(name, seconds) {
  const charts = {
    requests: chart({ title: 'Requests', kind: 'count', series: ['running', 'waiting'], seconds }),
    kv: chart({ title: 'KV cache usage', kind: 'percent', series: ['used'], seconds }),
    tokens: chart({ title: 'Output tokens/s', kind: 'rate', series: ['tokens', 'requests'], seconds }),
    ttft: chart({ title: 'Time to first token', kind: 'seconds', series: ['p50', 'p99'], seconds }),
    itl: chart({ title: 'Inter-token latency', kind: 'seconds', series: ['p50', 'p99'], seconds }),
  };
  const totals = h('p', { class: 'muted totals', 'data-model': name });
  const element = h(
    'section',
    { class: 'model-live', 'aria-label': `Model ${name}` },
    h('h2', {}, name),
    totals,
    h('div', { class: 'grid' }, Object.values(charts).map((c) => c.element)),
  );
  return { element, charts, totals };
}

export function mount(root, ctx) {
  let samples = [];
  let since = 0;
  let meta = { interval: 1, history_seconds: 300, quantile_window: 60 };
  const panels = new Map();
  const status = h('p', { class: 'muted', role: 'status' }, 'Loading live figures…');
  const models = h('div');
  let refusals = null;
  let refusalReasons = [];
  const refusalSlot = h('div', { class: 'grid' }, h('p', { class: 'muted' }, 'No request refused for capacity or rate limits in the last 5 minutes.'));
  replace(root, status, models, h('h2', {}, 'Refusals'), refusalSlot);
  let timer = null;

  function pointsFor(name, pick) {
    return samples.filter((s) => s.models[name]).map((s) => [s.t, pick(s.models[name])]);
  }

  function render() {
    const names = [...new Set(samples.flatMap((s) => Object.keys(s.models)))].sort();
    for (const name of names) {
      if (!panels.has(name)) {
        const panel = modelPanel(name, meta.history_seconds);
        panels.set(name, panel);
        models.append(panel.element);
      }
      const { charts, totals } = panels.get(name);
      charts.requests.update(pointsFor(name, (m) => [m.running, m.waiting]));
      charts.kv.update(pointsFor(name, (m) => [m.kv_usage]));
      charts.tokens.update(pointsFor(name, (m) => [m.output_tokens_per_s, m.requests_per_s]));
      charts.ttft.update(pointsFor(name, (m) => [m.ttft_p50, m.ttft_p99]));
      charts.itl.update(pointsFor(name, (m) => [m.itl_p50, m.itl_p99]));
      let tokens = 0;
      let finished = 0;
      for (const s of samples) {
        const m = s.models[name];
        if (!m) continue;
        tokens += (m.output_tokens_per_s || 0) * meta.interval;
        finished += (m.requests_per_s || 0) * meta.interval;
      }
      replace(
        totals,
        `Last ${Math.round(meta.history_seconds / 60)} min: `,
        h('span', { 'data-total': 'requests' }, String(Math.round(finished))),
        ' requests finished, ',
        h('span', { 'data-total': 'tokens' }, String(Math.round(tokens))),
        ` tokens generated. Latency quantiles over the last ${meta.quantile_window} s.`,
      );
    }
    const reasons = [...new Set(samples.flatMap((s) => Object.keys(s.refusals_per_s)))].sort();
    if (reasons.length && reasons.join() !== refusalReasons.join()) {
      refusalReasons = reasons;
      refusals = chart({ title: 'Refusals by reason (all models)', kind: 'rate', series: reasons, seconds: meta.history_seconds });
      replace(refusalSlot, refusals.element);
    }
    if (refusals) refusals.update(samples.map((s) => [s.t, refusalReasons.map((r) => s.refusals_per_s[r] ?? 0)]));
    const age = samples.length ? Math.max(0, Date.now() / 1000 - samples[samples.length - 1].t) : null;
    replace(
      status,
      names.length ? `${names.length} model${names.length > 1 ? 's' : ''}; ` : 'No model has reported yet; ',
      `refreshed every ${POLL_MS / 1000} s`,
      age !== null ? ` (latest sample ${format(age, 'seconds')} ago)` : '',
    );
  }

  async function poll() {
    try {
      const answer = await ctx.api.fetchJSON(`/console/live?since=${since}`, { signal: ctx.signal });
      meta = answer;
      if (answer.samples.length) {
        samples = samples.concat(answer.samples);
        since = samples[samples.length - 1].t;
        const keepFrom = since - answer.history_seconds;
        samples = samples.filter((s) => s.t > keepFrom);
      }
      render();
    } catch (err) {
      if (err.name === 'AbortError') return;
      if (err.status === 401 || err.status === 403) {
        showRefusal(root, err);
        stop();
        return;
      }
      replace(status, h('span', { class: 'error' }, err.message));
    }
  }

  function stop() {
    clearInterval(timer);
    timer = null;
  }

  const redraw = () => render();
  window.addEventListener('resize', redraw);
  poll();
  timer = setInterval(poll, POLL_MS);
  return () => {
    stop();
    window.removeEventListener('resize', redraw);
  };
}
