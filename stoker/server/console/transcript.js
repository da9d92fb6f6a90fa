// One turn of the playground's transcript as DOM: the answer as markdown (or
// as tokens coloured by their logprob), the reasoning collapsed apart from it,
// tool calls shown as calls, the reply's figures, and the turn's actions.
// Everything a model wrote goes through markdown.js or textContent.

import { h, replace } from './dom.js';
import { renderMarkdown } from './markdown.js';

// Probability bands of the token view, highest first: class p0 (likely) .. p4 (a surprise).
const BANDS = [0.9, 0.6, 0.3, 0.1];

function band(logprob) {
  const p = Math.exp(logprob);
  const index = BANDS.findIndex((floor) => p >= floor);
  return `p${index < 0 ? BANDS.length : index}`;
}

function percent(logprob) {
  const p = Math.exp(logprob) * 100;
  return p >= 10 ? `${p.toFixed(0)}%` : p >= 0.01 ? `${p.toFixed(2)}%` : '<0.01%';
}

/** A token as a person can read it: whitespace and control characters made visible. */
export function showToken(token) {
  return JSON.stringify(token).slice(1, -1).replace(/ /g, '␣') || '(empty)';
}

function describeToken(entry) {
  const alternatives = (entry.top_logprobs ?? [])
    .map((alt) => `${showToken(alt.token)} ${percent(alt.logprob)}`)
    .join(', ');
  return `${showToken(entry.token)}: ${percent(entry.logprob)} (logprob ${entry.logprob.toFixed(3)})` +
    (alternatives ? `. Alternatives: ${alternatives}` : '');
}

/** The one floating box that shows a token's alternatives on hover or focus. */
export function createTooltip() {
  const tip = h('div', { class: 'tok-tip', role: 'tooltip', id: 'tok-tip', hidden: true });

  function show(span, entry) {
    const rows = (entry.top_logprobs ?? []).map((alt) =>
      h('tr', { class: alt.token === entry.token ? 'chosen' : null },
        h('td', {}, h('code', {}, showToken(alt.token))), h('td', {}, percent(alt.logprob)), h('td', {}, alt.logprob.toFixed(3))),
    );
    replace(tip,
      h('p', {}, h('code', {}, showToken(entry.token)), ` ${percent(entry.logprob)} (logprob ${entry.logprob.toFixed(3)})`),
      rows.length ? h('table', {}, h('caption', {}, 'Top alternatives'), h('tbody', {}, rows)) : h('p', {}, 'No alternatives requested (set top logprobs).'));
    tip.hidden = false;
    const box = span.getBoundingClientRect();
    // CSSOM writes are allowed under the page's style-src 'self' (style attributes in markup are not).
    // Fixed to the viewport, kept inside it on a narrow window.
    tip.style.left = `${Math.max(4, Math.min(box.left, document.documentElement.clientWidth - tip.offsetWidth - 4))}px`;
    const below = box.bottom + 4;
    const fitsBelow = below + tip.offsetHeight <= window.innerHeight;
    tip.style.top = `${fitsBelow ? below : Math.max(4, box.top - tip.offsetHeight - 4)}px`;
    span.setAttribute('aria-describedby', tip.id);
  }

  function hide(span) {
    tip.hidden = true;
    span?.removeAttribute('aria-describedby');
  }

  return { element: tip, show, hide };
}

/**
 * The reply's tokens, each coloured by its probability, its alternatives on hover or focus.
 * One tab stop for the whole reply; the arrow keys, Home and End move between its tokens.
 */
export function renderTokens(logprobs, tooltip) {
  const view = h('div', { class: 'tokens', role: 'group', 'aria-label': 'Reply tokens coloured by probability (arrow keys move between them)' });
  view.addEventListener('keydown', (event) => {
    const spans = [...view.children];
    const at = spans.indexOf(document.activeElement);
    const to = { ArrowRight: at + 1, ArrowDown: at + 1, ArrowLeft: at - 1, ArrowUp: at - 1, Home: 0, End: spans.length - 1 }[event.key];
    if (at < 0 || to === undefined || !spans[to]) return;
    event.preventDefault();
    spans[at].tabIndex = -1;
    spans[to].tabIndex = 0;
    spans[to].focus();
  });
  for (const [i, entry] of logprobs.entries()) {
    const span = h('span', { class: `tok ${band(entry.logprob)}`, tabindex: i === 0 ? '0' : '-1', 'aria-label': describeToken(entry) }, entry.token);
    span.addEventListener('mouseenter', () => tooltip.show(span, entry));
    span.addEventListener('focus', () => tooltip.show(span, entry));
    span.addEventListener('mouseleave', () => tooltip.hide(span));
    span.addEventListener('blur', () => tooltip.hide(span));
    view.append(span);
  }
  return view;
}

export function legend() {
  const labels = ['≥ 90%', '60–90%', '30–60%', '10–30%', '< 10%'];
  return h('p', { class: 'tok-legend' }, 'Token probability: ', labels.map((label, i) => h('span', { class: `tok p${i}` }, label)));
}

function formatStats(stats) {
  const parts = [];
  if (stats.ttft_ms !== null && stats.ttft_ms !== undefined) parts.push(`TTFT ${Math.round(stats.ttft_ms)} ms`);
  if (stats.tokens_per_s) parts.push(`${stats.tokens_per_s.toFixed(1)} tokens/s`);
  if (stats.finish_reason) parts.push(`finish: ${stats.finish_reason}`);
  const u = stats.usage;
  if (u) parts.push(`usage: ${u.prompt_tokens} prompt + ${u.completion_tokens} completion = ${u.total_tokens} tokens`);
  return parts.join(' · ');
}

function toolCalls(calls) {
  return h('div', { class: 'tool-calls' }, calls.map((call) =>
    h('div', { class: 'tool-call' },
      h('span', { class: 'tool-call-label' }, 'Tool call '),
      h('code', {}, `${call.function.name}(${call.function.arguments})`),
      call.id ? h('span', { class: 'tool-call-id' }, ` id ${call.id}`) : null),
  ));
}

/** The answer part of a turn: markdown, or tokens when the token view is on and the reply has logprobs. */
export function renderBody(message, { tokensShown, tooltip }) {
  const body = h('div', { class: 'msg-body' });
  if (message.role === 'assistant' && message.reasoning) {
    body.append(h('details', { class: 'reasoning' },
      h('summary', {}, `Reasoning (${message.reasoning.length} characters)`),
      h('div', { class: 'reasoning-text' }, renderMarkdown(message.reasoning))));
  }
  if (tokensShown && message.logprobs?.length) {
    body.append(legend(), renderTokens(message.logprobs, tooltip));
  } else if (message.role === 'assistant') {
    body.append(h('div', { class: 'markdown' }, renderMarkdown(message.content)));
  } else {
    body.append(h('div', { class: 'user-text' }, message.content));
  }
  if (message.tool_calls?.length) body.append(toolCalls(message.tool_calls));
  return body;
}

/**
 * A turn as an <article>: who, the body, its figures, its actions.
 * actions: {edit, regenerate, branch, toggleTokens, switchTo(delta)}; versions: {index, count}.
 */
export function renderMessage(message, { versions, actions, tokensShown, tooltip, busy }) {
  const who = message.role === 'user' ? 'You' : `Assistant${message.model ? ` · ${message.model}` : ''}`;
  const buttons = [];
  if (versions.count > 1) {
    buttons.push(h('span', { class: 'versions' },
      h('button', { type: 'button', 'aria-label': 'Previous version of this turn', disabled: busy || versions.index === 0, onclick: () => actions.switchTo(-1) }, '‹'),
      h('span', { 'aria-label': `version ${versions.index + 1} of ${versions.count}` }, `${versions.index + 1} / ${versions.count}`),
      h('button', { type: 'button', 'aria-label': 'Next version of this turn', disabled: busy || versions.index === versions.count - 1, onclick: () => actions.switchTo(1) }, '›')));
  }
  if (message.role === 'user') {
    buttons.push(h('button', { type: 'button', disabled: busy, onclick: actions.edit }, 'Edit'));
  } else {
    buttons.push(h('button', { type: 'button', disabled: busy, onclick: actions.regenerate }, 'Regenerate'));
    if (message.logprobs?.length) {
      buttons.push(h('button', { type: 'button', 'aria-pressed': tokensShown ? 'true' : 'false', onclick: actions.toggleTokens }, 'Tokens'));
    }
  }
  buttons.push(h('button', { type: 'button', disabled: busy, onclick: actions.branch, title: 'A new conversation with the turns up to here' }, 'Branch'));
  return h('article', { class: `msg msg-${message.role}`, 'data-id': message.id },
    h('header', { class: 'msg-head' }, h('span', { class: 'msg-who' }, who), h('span', { class: 'msg-actions' }, buttons)),
    renderBody(message, { tokensShown, tooltip }),
    message.stats ? h('p', { class: 'msg-stats' }, formatStats(message.stats)) : null);
}

/** The figures line of a reply still streaming, or finished. */
export function statsLine(stats) {
  return h('p', { class: 'msg-stats' }, formatStats(stats));
}
