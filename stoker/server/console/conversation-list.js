// The playground's side panel: the conversations kept in this browser, a new
// one, delete, export (this one or all) and import, with what went wrong said
// in words. The conversation shown is the playground's; this panel asks it.

import { h, replace } from './dom.js';
import * as store from './conversations.js';

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

function plural(n) {
  return `${n} conversation${n === 1 ? '' : 's'}`;
}

/**
 * current(): the conversation shown; open(c): show c; fresh(): a new, empty conversation.
 * Returns {element, refresh}: refresh() lists the stored conversations again.
 */
export function createConversationList({ current, open, fresh }) {
  const list = h('ul', { class: 'pg-list' });
  const note = h('p', { class: 'pg-note', id: 'pg-io-note', role: 'status' });
  // The file input is reached through its label (a button to the eye and to Tab), so it is no tab stop of its own.
  const importInput = h('input', { id: 'pg-import', type: 'file', accept: 'application/json,.json', class: 'visually-hidden', tabindex: '-1' });

  function tell(message, isError = false) {
    note.className = isError ? 'pg-note error' : 'pg-note';
    replace(note, message);
  }

  async function refresh() {
    let all;
    try {
      all = await store.listConversations();
    } catch (error) {
      replace(list, h('li', { class: 'error' }, error.message));
      return;
    }
    const shown = current().id;
    replace(list, all.map((c) => h('li', {},
      h('button', { type: 'button', class: 'pg-open', 'aria-current': c.id === shown ? 'true' : null, onclick: () => open(c) }, c.title),
      h('button', { type: 'button', class: 'pg-delete', 'aria-label': `Delete conversation: ${c.title}`, onclick: () => remove(c) }, '×'))));
  }

  async function remove(c) {
    if (!window.confirm(`Delete the conversation "${c.title}" from this browser?`)) return;
    await store.deleteConversation(c.id);
    if (c.id === current().id) await open(fresh());
    else await refresh();
  }

  function exportCurrent() {
    const conversation = current();
    if (!conversation.messages.length) {
      tell('This conversation is empty: nothing to export.');
      return;
    }
    download(`stoker-chat-${slug(conversation.title)}.json`, store.exportJSON([conversation]));
    tell('Exported this conversation.');
  }

  async function exportAll() {
    const all = await store.listConversations();
    download(`stoker-conversations-${new Date().toISOString().slice(0, 10)}.json`, store.exportJSON(all));
    tell(`Exported ${plural(all.length)}.`);
  }

  importInput.addEventListener('change', async () => {
    const file = importInput.files[0];
    importInput.value = '';
    if (!file) return;
    try {
      if (file.size > store.LIMITS.fileBytes) throw new Error(`file: larger than ${store.LIMITS.fileBytes / 1024 / 1024} MiB`);
      const kept = await store.importConversations(await file.text());
      tell(`Imported ${plural(kept.length)} from ${file.name}.`);
      if (kept.length) await open(kept[0]);
      else await refresh();
    } catch (error) {
      tell(`${file.name} was not imported: ${error.message}`, true);
    }
  });

  const openPicker = (event) => {
    if (event.key === 'Enter' || event.key === ' ') {
      event.preventDefault();
      importInput.click();
    }
  };
  const element = h('aside', { class: 'pg-side', 'aria-labelledby': 'pg-side-title' },
    h('h2', { id: 'pg-side-title' }, 'Conversations'),
    h('button', { type: 'button', onclick: () => open(fresh()) }, 'New chat'),
    list,
    h('div', { class: 'pg-io' },
      h('button', { type: 'button', onclick: exportCurrent }, 'Export this'),
      h('button', { type: 'button', onclick: exportAll }, 'Export all'),
      h('label', { for: 'pg-import', class: 'button', role: 'button', tabindex: '0', onkeydown: openPicker }, 'Import JSON'),
      importInput),
    note);

  return { element, refresh };
}
