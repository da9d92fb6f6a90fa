// The chat playground (#/chat): streaming chat with any chat model of the
// fleet, with the key in the console's header (or none in open mode). A reply
// streams from /v1/chat/completions; its figures (TTFT, tokens/s, finish
// reason, usage) are measured here and by the server's usage chunk.
// Conversations are trees kept in this browser (conversations.js).

import { h, replace } from './dom.js';
import * as store from './conversations.js';
import { createSettings, DEFAULTS } from './chat-settings.js';
import { createConversationList } from './conversation-list.js';
import { createTooltip, renderBody, renderMessage, statsLine } from './transcript.js';

const LIST_TIMEOUT_MS = 10_000;
const LIST_RETRY_MS = 2_000;

/** A message of the branch as the API takes it. */
function apiMessage(m) {
  if (m.role === 'assistant' && m.tool_calls?.length) {
    return { role: 'assistant', content: m.content || null, tool_calls: m.tool_calls };
  }
  return { role: m.role, content: m.content };
}

export async function mount(root, ctx) {
  let conversation = store.newConversation(DEFAULTS);
  let streaming = null; // the AbortController of the reply in flight
  let modelProblem = null; // why the model list could not be had (a refused key, say)
  const tokensShown = new Set();
  const tooltip = createTooltip();

  const settings = createSettings(() => {
    if (!streaming) conversation.settings = settings.read();
  });
  const sidebar = createConversationList({
    current: () => conversation,
    open: (c) => open(c),
    fresh: () => store.newConversation(settings.read()),
  });
  const log = h('div', { class: 'pg-log', role: 'log', 'aria-label': 'Conversation', tabindex: '0' });
  const problem = h('p', { class: 'pg-error', id: 'pg-error', role: 'alert', hidden: true });
  const input = h('textarea', { id: 'pg-input', rows: '3', placeholder: 'Message', 'aria-describedby': 'pg-keys-hint' });
  const sendButton = h('button', { type: 'submit', class: 'primary' }, 'Send');
  const stopButton = h('button', { type: 'button', disabled: true, onclick: () => streaming?.abort() }, 'Stop');
  const composer = h('form', { class: 'pg-composer', onsubmit: (e) => { e.preventDefault(); send(); } },
    h('label', { for: 'pg-input' }, 'Message'), input,
    h('div', { class: 'pg-send' }, sendButton, stopButton,
      h('span', { class: 'pg-note', id: 'pg-keys-hint' }, 'Enter sends · Shift+Enter: new line · Esc stops the reply')));

  replace(root, h('div', { class: 'pg' },
    sidebar.element,
    h('section', { class: 'pg-main', 'aria-labelledby': 'pg-chat-title' },
      h('h2', { id: 'pg-chat-title', class: 'visually-hidden' }, 'Chat'),
      log, problem, composer),
    settings.element,
    tooltip.element));

  function say(message) {
    problem.hidden = !message;
    replace(problem, message ?? '');
  }

  function setBusy(busy) {
    sendButton.disabled = busy;
    stopButton.disabled = !busy;
    log.setAttribute('aria-busy', busy ? 'true' : 'false');
  }

  // ---- the transcript -------------------------------------------------------

  function render() {
    const branch = conversation.leaf ? store.pathTo(conversation, conversation.leaf) : [];
    replace(log, branch.length ? branch.map(renderTurn) : h('p', { class: 'pg-empty' }, 'Send a message to start. Replies stream here.'));
    log.scrollTop = log.scrollHeight;
  }

  function renderTurn(m) {
    const siblings = store.children(conversation, m.parent);
    return renderMessage(m, {
      versions: { index: siblings.indexOf(m), count: siblings.length },
      tokensShown: tokensShown.has(m.id),
      tooltip,
      busy: streaming !== null,
      actions: {
        edit: () => edit(m),
        regenerate: () => generate(m.parent),
        branch: () => branch(m),
        toggleTokens: () => {
          if (!tokensShown.delete(m.id)) tokensShown.add(m.id);
          render();
        },
        switchTo: (delta) => {
          const target = siblings[siblings.indexOf(m) + delta];
          conversation.leaf = store.leafUnder(conversation, target.id);
          persist();
          render();
        },
      },
    });
  }

  function edit(m) {
    const article = log.querySelector(`[data-id="${m.id}"]`);
    const box = h('textarea', { id: 'pg-edit', rows: '3', value: m.content });
    const form = h('form', { class: 'pg-edit', onsubmit: (e) => {
      e.preventDefault();
      if (!box.value.trim()) return;
      const changed = store.addMessage(conversation, m.parent, { role: 'user', content: box.value });
      generate(changed.id);
    } },
    h('label', { for: 'pg-edit' }, 'Edit this message (sent as a new version; the old one stays)'), box,
    h('div', {}, h('button', { type: 'submit', class: 'primary' }, 'Send as new version'), h('button', { type: 'button', onclick: render }, 'Cancel')));
    article.querySelector('.msg-body').replaceWith(form);
    box.focus();
  }

  async function branch(m) {
    const copy = store.branchFrom(conversation, m.id);
    await store.saveConversation(copy);
    await open(copy);
    ctx.notify(`Branched into a new conversation: ${copy.title}`);
  }

  // ---- sending --------------------------------------------------------------

  async function send() {
    if (streaming) return;
    const text = input.value;
    if (!text.trim()) return;
    if (modelProblem) {
      say(modelProblem);
      return;
    }
    if (!settings.check()) return;
    const user = store.addMessage(conversation, conversation.leaf, { role: 'user', content: text });
    input.value = '';
    await generate(user.id);
  }

  /** A reply to the turn parentId, streamed into a new assistant turn under it. */
  async function generate(parentId) {
    if (streaming) return;
    const fields = settings.check();
    if (!fields) return;
    say(null);
    conversation.settings = settings.read();
    const system = conversation.settings.system.trim() ? [{ role: 'system', content: conversation.settings.system }] : [];
    const body = {
      ...fields,
      messages: [...system, ...store.pathTo(conversation, parentId).map(apiMessage)],
      stream: true,
      stream_options: { include_usage: true },
    };
    const reply = store.addMessage(conversation, parentId, { role: 'assistant', content: '', model: fields.model });
    const stats = { ttft_ms: null, tokens_per_s: null, finish_reason: null, usage: null };
    reply.stats = stats;
    const calls = [];
    streaming = new AbortController();
    const stopOnLeave = () => streaming?.abort();
    ctx.signal.addEventListener('abort', stopOnLeave);
    setBusy(true);
    render();
    const article = log.querySelector(`[data-id="${reply.id}"]`);
    let updates = 0;
    let pending = false;
    const show = () => {
      pending = false;
      article.querySelector('.msg-body').replaceWith(renderBody(reply, { tokensShown: false, tooltip }));
      article.querySelector('.msg-stats').replaceWith(statsLine(stats));
      article.dataset.updates = String(++updates);
      log.scrollTop = log.scrollHeight;
    };
    const schedule = () => {
      if (!pending) {
        pending = true;
        requestAnimationFrame(show);
      }
    };
    const started = performance.now();
    let first = null;
    let last = null;
    let failure = null;
    try {
      await ctx.api.stream('/v1/chat/completions', body, ({ data }) => {
        if (data?.error) throw new Error(`The reply stopped: ${data.error.message ?? JSON.stringify(data.error)}`);
        if (data?.usage) stats.usage = data.usage;
        for (const choice of data?.choices ?? []) {
          const delta = choice.delta ?? {};
          const thinking = delta.reasoning_content ?? delta.reasoning;
          if (delta.content) reply.content += delta.content;
          if (thinking) reply.reasoning = (reply.reasoning ?? '') + thinking;
          for (const part of delta.tool_calls ?? []) {
            const call = (calls[part.index ?? 0] ??= { id: '', type: 'function', function: { name: '', arguments: '' } });
            if (part.id) call.id = part.id;
            if (part.function?.name) call.function.name = part.function.name;
            if (part.function?.arguments) call.function.arguments += part.function.arguments;
          }
          if (calls.length) reply.tool_calls = calls.filter(Boolean);
          if (choice.logprobs?.content) {
            reply.logprobs ??= [];
            for (const t of choice.logprobs.content) {
              reply.logprobs.push({ token: t.token, logprob: t.logprob, top_logprobs: (t.top_logprobs ?? []).map((a) => ({ token: a.token, logprob: a.logprob })) });
            }
          }
          if (choice.finish_reason) stats.finish_reason = choice.finish_reason;
          if (delta.content || thinking || delta.tool_calls) {
            last = performance.now();
            first ??= last;
            stats.ttft_ms ??= first - started;
          }
        }
        schedule();
      }, { signal: streaming.signal });
    } catch (error) {
      if (error.name === 'AbortError') stats.finish_reason = 'stopped by you';
      else failure = error;
    }
    ctx.signal.removeEventListener('abort', stopOnLeave);
    const tokens = stats.usage?.completion_tokens ?? reply.logprobs?.length;
    // Decode speed: the tokens after the first over the time after the first (TTFT is shown apart).
    if (tokens > 1 && last > first) stats.tokens_per_s = ((tokens - 1) * 1000) / (last - first);
    streaming = null;
    setBusy(false);
    if (failure && !reply.content && !reply.reasoning && !reply.tool_calls) {
      conversation.messages.splice(conversation.messages.indexOf(reply), 1);
      conversation.leaf = parentId;
    }
    if (failure) {
      stats.finish_reason ??= 'error';
      say(failure.message);
    }
    await persist();
    if (!ctx.signal.aborted) render();
  }

  // ---- conversations --------------------------------------------------------

  async function persist() {
    if (!conversation.messages.length) return;
    conversation.updated = Date.now();
    try {
      await store.saveConversation(conversation);
    } catch (error) {
      say(`This conversation could not be kept in the browser: ${error.message}`);
    }
    await sidebar.refresh();
  }

  async function open(c) {
    if (streaming) {
      say('A reply is still streaming: stop it (Esc) before opening another conversation.');
      return;
    }
    conversation = c;
    tokensShown.clear();
    settings.write(c.settings);
    say(null);
    render();
    await sidebar.refresh();
  }

  // ---- models and keys ------------------------------------------------------

  let listings = 0;
  let retryTimer = null;

  async function loadModels() {
    // Only the latest listing counts: one asked before a key was entered may answer after the one asked with it.
    const mine = ++listings;
    clearTimeout(retryTimer);
    try {
      // A listing that hangs (a server too busy to answer) is given up and asked again, never waited on forever.
      const signal = AbortSignal.any([ctx.signal, AbortSignal.timeout(LIST_TIMEOUT_MS)]);
      const listing = await ctx.api.fetchJSON('/v1/models', { signal });
      if (mine !== listings) return;
      // Chat models: the fleet's of kind generate, and the LoRA adapters on them (listed with a parent);
      // rerankers and the embedding model are left out.
      const ids = (listing?.data ?? []).filter((m) => m.kind === 'generate' || m.parent !== undefined).map((m) => m.id);
      modelProblem = null;
      say(null);
      settings.setModels(ids, ids.length ? null : 'This server serves no chat model.');
      if (conversation.settings.model && ids.includes(conversation.settings.model)) settings.write(conversation.settings);
      conversation.settings.model = settings.read().model;
    } catch (error) {
      if (ctx.signal.aborted || mine !== listings) return;
      modelProblem = `The models could not be listed: ${error.message}`;
      settings.setModels([], modelProblem);
      // A refused key waits for the user to enter another; an unreachable server for the banner's
      // reconnect; a busy, slow or failing server is asked again by itself.
      if (error.status !== 401 && error.status !== 403 && error.status !== 0) {
        retryTimer = setTimeout(loadModels, LIST_RETRY_MS);
      }
    }
  }

  // ---- keyboard -------------------------------------------------------------

  input.addEventListener('keydown', (event) => {
    if (event.key === 'Enter' && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send();
    }
  });
  const onEscape = (event) => {
    if (event.key === 'Escape' && streaming) {
      event.preventDefault();
      streaming.abort();
    }
  };
  document.addEventListener('keydown', onEscape);

  ctx.onKeyChange(loadModels);
  ctx.onReconnect(loadModels);
  settings.write(DEFAULTS);
  render();
  await Promise.all([loadModels(), sidebar.refresh()]);
  // Only if nothing has the focus yet: a user already typing (an API key, say) keeps typing there,
  // rather than the rest of what they type landing in the message box.
  if (document.activeElement === null || document.activeElement === document.body) input.focus();

  return () => {
    document.removeEventListener('keydown', onEscape);
    clearTimeout(retryTimer);
    streaming?.abort();
  };
}
