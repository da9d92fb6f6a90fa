// The playground's conversations: a tree of turns (an edited or regenerated
// turn is a sibling of the one it replaces, so no branch is ever lost), kept in
// this browser's IndexedDB, exported and imported as JSON. Nothing here is sent
// to the server except the path the user is on, as a request's messages.

const DB_NAME = 'stoker-console';
const STORE = 'conversations';
export const FORMAT = 'stoker.conversations';
export const FORMAT_VERSION = 1;

/** Bounds on an imported file, so a hostile or damaged one is refused before it fills the browser's storage. */
export const LIMITS = Object.freeze({
  fileBytes: 50 * 1024 * 1024,
  conversations: 1000,
  messages: 10000,
  contentChars: 1_000_000,
  titleChars: 200,
  logprobs: 100_000,
  topLogprobs: 20,
});

const ROLES = new Set(['user', 'assistant']);
const SETTING_TYPES = {
  model: 'string',
  system: 'string',
  temperature: 'number',
  top_p: 'number',
  max_tokens: 'number',
  seed: 'number',
  stop: 'string',
  logprobs: 'boolean',
  top_logprobs: 'number',
  schema: 'string',
  tools: 'string',
  tool_choice: 'string',
};

export function newId() {
  return crypto.randomUUID();
}

export function newConversation(settings = {}) {
  const now = Date.now();
  return { id: newId(), title: 'New chat', created: now, updated: now, settings: { ...settings }, messages: [], leaf: null };
}

// ---- the tree ---------------------------------------------------------------

/** The turns from the first to id (the branch the user sees), oldest first. */
export function pathTo(conversation, id) {
  const byId = new Map(conversation.messages.map((m) => [m.id, m]));
  const path = [];
  for (let m = byId.get(id); m; m = byId.get(m.parent)) path.push(m);
  return path.reverse();
}

/** The turns that answer or follow parent (null: the first turns), oldest first. */
export function children(conversation, parent) {
  return conversation.messages.filter((m) => m.parent === parent);
}

/** The newest turn at the end of the branch through id: where switching to id's branch lands. */
export function leafUnder(conversation, id) {
  let leaf = id;
  for (let next = children(conversation, leaf); next.length; next = children(conversation, leaf)) {
    leaf = next[next.length - 1].id;
  }
  return leaf;
}

/** A turn added under parent, and the conversation's branch moved to it. */
export function addMessage(conversation, parent, fields) {
  const message = { id: newId(), parent, created: Date.now(), ...fields };
  conversation.messages.push(message);
  conversation.leaf = message.id;
  conversation.updated = Date.now();
  if (conversation.title === 'New chat' && message.role === 'user' && message.content.trim()) {
    conversation.title = message.content.trim().replace(/\s+/g, ' ').slice(0, 60);
  }
  return message;
}

/** A new conversation holding only the branch up to id (its settings copied). */
export function branchFrom(conversation, id) {
  const copy = newConversation(conversation.settings);
  copy.title = `${conversation.title} (branch)`.slice(0, LIMITS.titleChars);
  const ids = new Map();
  for (const m of pathTo(conversation, id)) {
    const fresh = { ...m, id: newId(), parent: m.parent === null ? null : ids.get(m.parent) };
    ids.set(m.id, fresh.id);
    copy.messages.push(fresh);
  }
  copy.leaf = ids.get(id) ?? null;
  return copy;
}

// ---- storage ----------------------------------------------------------------

let opening = null;

function database() {
  opening ??= new Promise((resolve, reject) => {
    const request = indexedDB.open(DB_NAME, 1);
    request.onupgradeneeded = () => {
      request.result.createObjectStore(STORE, { keyPath: 'id' });
    };
    request.onsuccess = () => resolve(request.result);
    request.onerror = () => {
      opening = null;
      reject(new Error(`This browser's storage cannot be opened (${request.error?.message ?? 'unknown error'}).`));
    };
  });
  return opening;
}

async function transact(mode, act) {
  const db = await database();
  return new Promise((resolve, reject) => {
    const tx = db.transaction(STORE, mode);
    const request = act(tx.objectStore(STORE));
    tx.oncomplete = () => resolve(request?.result);
    tx.onerror = () => reject(tx.error);
    tx.onabort = () => reject(tx.error ?? new Error('storage transaction aborted'));
  });
}

/** Every stored conversation, the most recently changed first. */
export async function listConversations() {
  const all = (await transact('readonly', (store) => store.getAll())) ?? [];
  return all.sort((a, b) => b.updated - a.updated);
}

export function saveConversation(conversation) {
  return transact('readwrite', (store) => store.put(conversation));
}

export function deleteConversation(id) {
  return transact('readwrite', (store) => store.delete(id));
}

// ---- export and import ------------------------------------------------------

export function exportJSON(conversations) {
  const file = { format: FORMAT, version: FORMAT_VERSION, exported: new Date().toISOString(), conversations };
  return JSON.stringify(file, null, 2);
}

class ImportError extends Error {}

function check(condition, where, what) {
  if (!condition) throw new ImportError(`${where}: ${what}`);
}

function checkString(value, where, max) {
  check(typeof value === 'string', where, 'must be a string');
  check(value.length <= max, where, `longer than ${max} characters`);
}

function checkNumber(value, where) {
  check(typeof value === 'number' && Number.isFinite(value), where, 'must be a finite number');
}

function isObject(value) {
  return value !== null && typeof value === 'object' && !Array.isArray(value);
}

function checkOptional(value, where, type) {
  if (value !== undefined && value !== null) check(typeof value === type && (type !== 'number' || Number.isFinite(value)), where, `must be a ${type} or null`);
  return value ?? null;
}

// Each check returns the part rebuilt from the fields this console knows, so
// nothing else a file carries is kept (or ever sent to the server with a turn).

function checkLogprob(entry, where) {
  check(isObject(entry), where, 'must be an object');
  checkString(entry.token, `${where}.token`, LIMITS.contentChars);
  checkNumber(entry.logprob, `${where}.logprob`);
  return { token: entry.token, logprob: entry.logprob };
}

function checkToolCall(call, at) {
  check(isObject(call) && isObject(call.function), at, 'must be {"id", "type": "function", "function": {"name", "arguments"}}');
  if (call.id !== undefined) checkString(call.id, `${at}.id`, 256);
  check(call.type === undefined || call.type === 'function', `${at}.type`, 'must be "function"');
  checkString(call.function.name, `${at}.function.name`, 64);
  checkString(call.function.arguments, `${at}.function.arguments`, LIMITS.contentChars);
  return { id: call.id ?? '', type: 'function', function: { name: call.function.name, arguments: call.function.arguments } };
}

function checkStats(stats, where) {
  check(isObject(stats), where, 'must be an object');
  let usage = null;
  if (stats.usage !== undefined && stats.usage !== null) {
    check(isObject(stats.usage), `${where}.usage`, 'must be an object or null');
    usage = {};
    for (const key of ['prompt_tokens', 'completion_tokens', 'total_tokens']) {
      checkNumber(stats.usage[key], `${where}.usage.${key}`);
      usage[key] = stats.usage[key];
    }
  }
  const finish = checkOptional(stats.finish_reason, `${where}.finish_reason`, 'string');
  check(finish === null || finish.length <= 64, `${where}.finish_reason`, 'longer than 64 characters');
  return {
    ttft_ms: checkOptional(stats.ttft_ms, `${where}.ttft_ms`, 'number'),
    tokens_per_s: checkOptional(stats.tokens_per_s, `${where}.tokens_per_s`, 'number'),
    finish_reason: finish,
    usage,
  };
}

function checkMessage(m, where, seen) {
  check(isObject(m), where, 'must be an object');
  checkString(m.id, `${where}.id`, 100);
  check(!seen.has(m.id), `${where}.id`, `"${m.id}" is used twice`);
  check(m.parent === null || seen.has(m.parent), `${where}.parent`, 'must be null or the id of an earlier message');
  check(ROLES.has(m.role), `${where}.role`, 'must be "user" or "assistant"');
  checkString(m.content, `${where}.content`, LIMITS.contentChars);
  const kept = { id: m.id, parent: m.parent, role: m.role, content: m.content };
  if (m.created !== undefined) kept.created = checkOptional(m.created, `${where}.created`, 'number');
  if (m.reasoning !== undefined) {
    checkString(m.reasoning, `${where}.reasoning`, LIMITS.contentChars);
    kept.reasoning = m.reasoning;
  }
  if (m.model !== undefined) {
    checkString(m.model, `${where}.model`, 256);
    kept.model = m.model;
  }
  if (m.tool_calls !== undefined) {
    check(Array.isArray(m.tool_calls) && m.tool_calls.length <= 128, `${where}.tool_calls`, 'must be a list of at most 128 calls');
    kept.tool_calls = m.tool_calls.map((call, k) => checkToolCall(call, `${where}.tool_calls[${k}]`));
  }
  if (m.logprobs !== undefined) {
    check(Array.isArray(m.logprobs) && m.logprobs.length <= LIMITS.logprobs, `${where}.logprobs`, `must be a list of at most ${LIMITS.logprobs} tokens`);
    kept.logprobs = m.logprobs.map((entry, k) => {
      const at = `${where}.logprobs[${k}]`;
      const top = entry?.top_logprobs ?? [];
      check(Array.isArray(top) && top.length <= LIMITS.topLogprobs, `${at}.top_logprobs`, `must be a list of at most ${LIMITS.topLogprobs}`);
      return { ...checkLogprob(entry, at), top_logprobs: top.map((alt, j) => checkLogprob(alt, `${at}.top_logprobs[${j}]`)) };
    });
  }
  if (m.stats !== undefined) kept.stats = checkStats(m.stats, `${where}.stats`);
  seen.add(m.id);
  return kept;
}

function checkConversation(c, where) {
  check(isObject(c), where, 'must be an object');
  checkString(c.id, `${where}.id`, 100);
  checkString(c.title, `${where}.title`, LIMITS.titleChars);
  checkNumber(c.created, `${where}.created`);
  checkNumber(c.updated, `${where}.updated`);
  check(isObject(c.settings), `${where}.settings`, 'must be an object');
  for (const [key, value] of Object.entries(c.settings)) {
    check(key in SETTING_TYPES, `${where}.settings.${key}`, `is not a setting (known: ${Object.keys(SETTING_TYPES).join(', ')})`);
    check(value === null || typeof value === SETTING_TYPES[key], `${where}.settings.${key}`, `must be a ${SETTING_TYPES[key]} or null`);
    if (typeof value === 'string') check(value.length <= LIMITS.contentChars, `${where}.settings.${key}`, `longer than ${LIMITS.contentChars} characters`);
  }
  check(Array.isArray(c.messages), `${where}.messages`, 'must be a list');
  check(c.messages.length <= LIMITS.messages, `${where}.messages`, `more than ${LIMITS.messages} messages`);
  const seen = new Set();
  const messages = c.messages.map((m, i) => checkMessage(m, `${where}.messages[${i}]`, seen));
  check(c.leaf === null || seen.has(c.leaf), `${where}.leaf`, 'must be null or the id of one of its messages');
  return { id: c.id, title: c.title, created: c.created, updated: c.updated, settings: { ...c.settings }, messages, leaf: c.leaf };
}

/**
 * The conversations in an exported file's text, checked whole before any is kept;
 * throws an Error whose message says where the file is wrong.
 */
export function parseImport(text) {
  check(text.length <= LIMITS.fileBytes, 'file', `larger than ${LIMITS.fileBytes / 1024 / 1024} MiB`);
  let file;
  try {
    file = JSON.parse(text);
  } catch (error) {
    throw new ImportError(`file: not JSON (${error.message})`);
  }
  check(file !== null && typeof file === 'object' && !Array.isArray(file), 'file', 'must be a JSON object');
  check(file.format === FORMAT, 'format', `must be "${FORMAT}" (a file exported by this console)`);
  check(file.version === FORMAT_VERSION, 'version', `must be ${FORMAT_VERSION}; this file says ${JSON.stringify(file.version)}`);
  check(Array.isArray(file.conversations), 'conversations', 'must be a list');
  check(file.conversations.length <= LIMITS.conversations, 'conversations', `more than ${LIMITS.conversations}`);
  return file.conversations.map((c, i) => checkConversation(c, `conversations[${i}]`));
}

/** The file's conversations kept (and returned); one whose id is already here gets a new id, so an import never overwrites. */
export async function importConversations(text) {
  const incoming = parseImport(text);
  const existing = new Set((await listConversations()).map((c) => c.id));
  const kept = incoming.map((c) => (existing.has(c.id) ? { ...c, id: newId() } : c));
  for (const c of kept) {
    existing.add(c.id);
    await saveConversation(c);
  }
  return kept;
}
