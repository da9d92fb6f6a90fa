// Small time-series charts on <canvas>: no library, nothing fetched. Each chart
// has a text legend with the latest values (what a screen reader and a test
// read) and an aria-label that says the same.
import { h } from './dom.js';

const SERIES_COLOURS = ['--series-1', '--series-2', '--series-3', '--series-4'];

function cssVar(name) {
  return getComputedStyle(document.documentElement).getPropertyValue(name).trim() || '#888';
}

/** A number for people: 3 significant figures, units by format(kind). */
export function format(value, kind) {
  if (value === null || value === undefined || Number.isNaN(value)) return '–';
  if (value === 0 && kind !== 'percent') return kind === 'rate' ? '0/s' : '0';
  if (kind === 'percent') return `${(value * 100).toFixed(value < 0.1 ? 1 : 0)}%`;
  if (kind === 'seconds') {
    if (value < 1) return `${(value * 1000).toPrecision(3)} ms`;
    return `${value.toPrecision(3)} s`;
  }
  if (kind === 'rate') return `${value < 10 ? value.toFixed(1) : Math.round(value)}/s`;
  return Number.isInteger(value) ? String(value) : value.toFixed(1);
}

/**
 * chart({title, kind, series: [label, ...], seconds}) -> {element, update(points)}
 * update(points): points is a list of [t (s), [value per series]] oldest first;
 * null values leave a gap.
 */
export function chart({ title, kind, series, seconds = 300 }) {
  const canvas = h('canvas', { class: 'chart', role: 'img', 'aria-label': `${title}: no data yet` });
  const values = series.map(() => h('span', { class: 'value' }, '–'));
  const legend = h(
    'ul',
    { class: 'legend' },
    series.map((label, i) =>
      h(
        'li',
        { 'data-series': label },
        h('span', { class: 'swatch', 'data-colour': SERIES_COLOURS[i % SERIES_COLOURS.length] }),
        `${label}: `,
        values[i],
      ),
    ),
  );
  const element = h('figure', { class: 'card', 'data-chart': title }, h('h3', {}, title), canvas, legend);
  let last = [];

  function colours() {
    return series.map((_, i) => cssVar(SERIES_COLOURS[i % SERIES_COLOURS.length]));
  }

  function paintSwatches(palette) {
    legend.querySelectorAll('.swatch').forEach((swatch, i) => {
      swatch.style.background = palette[i];
    });
  }

  function draw() {
    const points = last;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth || 300;
    const height = canvas.clientHeight || 140;
    canvas.width = Math.round(width * ratio);
    canvas.height = Math.round(height * ratio);
    const g = canvas.getContext('2d');
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, width, height);
    const palette = colours();
    paintSwatches(palette);
    const pad = { left: 52, right: 8, top: 8, bottom: 18 };
    const now = points.length ? points[points.length - 1][0] : Date.now() / 1000;
    const from = now - seconds;
    let top = 0;
    for (const [, row] of points) for (const v of row) if (v !== null && v > top) top = v;
    if (kind === 'percent') top = Math.max(top, 1);
    top = top > 0 ? niceCeiling(top) : 1;
    const x = (t) => pad.left + ((t - from) / seconds) * (width - pad.left - pad.right);
    const y = (v) => height - pad.bottom - (v / top) * (height - pad.top - pad.bottom);
    g.strokeStyle = cssVar('--border');
    g.fillStyle = cssVar('--muted');
    g.font = '11px system-ui, sans-serif';
    g.lineWidth = 1;
    for (const frac of [0, 0.5, 1]) {
      const yy = y(top * frac);
      g.beginPath();
      g.moveTo(pad.left, yy);
      g.lineTo(width - pad.right, yy);
      g.stroke();
      g.fillText(format(top * frac, kind), 2, yy + 4);
    }
    g.fillText(`−${span(seconds)}`, pad.left, height - 4);
    g.fillText('now', width - pad.right - 22, height - 4);
    series.forEach((_, i) => {
      g.strokeStyle = palette[i];
      g.lineWidth = 2;
      g.beginPath();
      let pen = false;
      for (const [t, row] of points) {
        const v = row[i];
        if (v === null || v === undefined || t < from) {
          pen = false;
          continue;
        }
        if (pen) g.lineTo(x(t), y(v));
        else g.moveTo(x(t), y(v));
        pen = true;
      }
      g.stroke();
    });
  }

  function update(points) {
    last = points;
    const latest = points.length ? points[points.length - 1][1] : series.map(() => null);
    const words = series.map((label, i) => `${label} ${format(latest[i], kind)}`);
    series.forEach((_, i) => {
      values[i].textContent = format(latest[i], kind);
    });
    canvas.setAttribute('aria-label', `${title}, latest: ${words.join(', ')}`);
    if (element.isConnected) draw();
  }

  return { element, update };
}

function span(seconds) {
  if (seconds >= 2 * 86400) return `${Math.round(seconds / 86400)} days`;
  if (seconds >= 2 * 3600) return `${Math.round(seconds / 3600)} h`;
  return `${Math.round(seconds / 60)} min`;
}

function niceCeiling(value) {
  const power = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) if (value <= step * power) return step * power;
  return 10 * power;
}
