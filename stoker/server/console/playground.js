// The chat playground (#/chat): streaming chat with any chat model of the
// fleet, with the key in the console's header (or none in open mode). A reply
// streams from /v1/chat/completions; its figures (TTFT, tokens/s, finish
// reason, usage) are measured here and by the server's usage chunk.
// Conversations are trees kept in this browser (conversations.js).

import { h, replace } from './dom.js';
import * as store from './conversations.js';
import { createSettings, DEFAULTS } from './chat-settings.js';
import { createTooltip, renderBody, renderMessage, statsLine } from './transcript.js';

/** A message of the branch as the API takes it. */
function apiMessage(m) {
  if (m.role === 'assistant' && m.tool_calls?.length) {
    return { role: 'assistant', content: m.content || null, tool_calls: m.tool_calls };
  }
  return { role: m.role, content: m.content };
}

function download(name, text) {
  const url = URL.createObjectURL(new Blob([text], { type: 'application/json' }));
  const a = h('a', { href: url, download: name });
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(url), 10_000);
}

function slug(text) {
  return text.toLowerCase().replace(/[^a-z0-9]+/g, '-').replace(/^-|-$/g, '').slice(0, 40) || 'chat';
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
  const list = h('ul', { class: 'pg-list' });
  // The file input is reached through its label (a button to the eye and to Tab), so it is no tab stop of its own.
  const importInput = h('input', { id: 'pg-import', type: 'file', accept: 'application/json,.json', class: 'visually-hidden', tabindex: '-1' });
  const ioNote = h('p', { class: 'pg-note', id: 'pg-io-note', role: 'status' });
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
    h('aside', { class: 'pg-side', 'aria-labelledby': 'pg-side-title' },
      h('h2', { id: 'pg-side-title' }, 'Conversations'),
      h('button', { type: 'button', onclick: () => open(store.newConversation(settings.read())) }, 'New chat'),
      list,
      h('div', { class: 'pg-io' },
        h('button', { type: 'button', onclick: exportCurrent }, 'Export this'),
        h('button', { type: 'button', onclick: exportAll }, 'Export all'),
        h('label', { for: 'pg-import', class: 'button', tabindex: '0', onkeydown: (e) => { if (e.key === 'Enter' || e.key === ' ') { e.preventDefault(); importInput.click(); } } }, 'Import JSON'),
        importInput),
      ioNote),
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
    await refreshList();
  }

  async function refreshList() {
    let all;
    try {
      all = await store.listConversations();
    } catch (error) {
      replace(list, h('li', { class: 'error' }, error.message));
      return;
    }
    replace(list, all.map((c) => h('li', {},
      h('button', { type: 'button', class: 'pg-open', 'aria-current': c.id === conversation.id ? 'true' : null, onclick: () => open(c) }, c.title),
      h('button', { type: 'button', class: 'pg-delete', 'aria-label': `Delete conversation: ${c.title}`, onclick: () => remove(c) }, '×'))));
  }

  async function open(c) {
    if (streaming) return;
    conversation = c;
    tokensShown.clear();
    settings.write(c.settings);
    say(null);
    render();
    await refreshList();
  }

  async function remove(c) {
    if (!window.confirm(`Delete the conversation "${c.title}" from this browser?`)) return;
    await store.deleteConversation(c.id);
    if (c.id === conversation.id) await open(store.newConversation(settings.read()));
    else await refreshList();
  }

  function exportCurrent() {
    if (!conversation.messages.length) {
      replace(ioNote, 'This conversation is empty: nothing to export.');
      return;
    }
    download(`stoker-chat-${slug(conversation.title)}.json`, store.exportJSON([conversation]));
    replace(ioNote, 'Exported this conversation.');
  }

  async function exportAll() {
    const all = await store.listConversations();
    download(`stoker-conversations-${new Date().toISOString().slice(0, 10)}.json`, store.exportJSON(all));
    replace(ioNote, `Exported ${all.length} conversation${all.length === 1 ? '' : 's'}.`);
  }

  importInput.addEventListener('change', async () => {
    const file = importInput.files[0];
    importInput.value = '';
    if (!file) return;
    ioNote.className = 'pg-note';
    try {
      if (file.size > store.LIMITS.fileBytes) throw new Error(`file: larger than ${store.LIMITS.fileBytes / 1024 / 1024} MiB`);
      const kept = await store.importConversations(await file.text());
      replace(ioNote, `Imported ${kept.length} conversation${kept.length === 1 ? '' : 's'} from ${file.name}.`);
      if (kept.length) await open(kept[0]);
      else await refreshList();
    } catch (error) {
      ioNote.className = 'pg-note error';
      replace(ioNote, `${file.name} was not imported: ${error.message}`);
    }
  });

  // ---- models and keys ------------------------------------------------------

  let listings = 0;

  async function loadModels() {
    // Only the latest listing counts: one asked before a key was entered may answer after the one asked with it.
    const mine = ++listings;
    try {
      const listing = await ctx.api.fetchJSON('/v1/models', { signal: ctx.signal });
      if (mine !== listings) return;
      // Chat models are the fleet's, which carry a version; the embedding model's entry has none.
      const ids = (listing?.data ?? []).filter((m) => m.version !== undefined).map((m) => m.id);
      modelProblem = null;
      say(null);
      settings.setModels(ids, ids.length ? null : 'This server serves no chat model.');
      if (conversation.settings.model && ids.includes(conversation.settings.model)) settings.write(conversation.settings);
      conversation.settings.model = settings.read().model;
    } catch (error) {
      if (error.name === 'AbortError' || mine !== listings) return;
      modelProblem = `The models could not be listed: ${error.message}`;
      settings.setModels([], modelProblem);
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
  await Promise.all([loadModels(), refreshList()]);
  input.focus();

  return () => {
    document.removeEventListener('keydown', onEscape);
    streaming?.abort();
  };
}
