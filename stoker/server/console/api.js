// The console's one client of the stoker API: the key, error messages a person
// can act on, JSON calls, and server-sent events read over fetch.

const KEY_ITEM = 'stoker.apiKey';

/** A refused or failed call: status 0 means the server could not be reached. */
export class ApiError extends Error {
  constructor(status, message, code = null) {
    super(message);
    this.name = 'ApiError';
    this.status = status;
    this.code = code;
  }
}

/** What to tell a person for each refusal, before the server's own words. */
function explain(status, serverMessage, code) {
  const said = serverMessage ? ` (server: ${serverMessage})` : '';
  if (status === 401) {
    if (code === 'api_key_revoked') return `This API key has been revoked. Enter another key.${said}`;
    if (code === 'api_key_expired') return `This API key has expired. Enter another key.${said}`;
    if (code === 'missing_api_key') return `This server needs an API key: enter one above.${said}`;
    return `The server refused this API key: it is wrong or unknown. Check it and enter it again.${said}`;
  }
  if (status === 403) return `Not allowed with this key${said}`;
  if (status === 429) return `Too many requests or over budget${said}`;
  if (status === 503) return `The server is busy, loading or shutting down${said}`;
  return serverMessage || `The server answered ${status}`;
}

async function errorFrom(response) {
  let message = '';
  let code = null;
  try {
    const body = await response.json();
    message = body?.error?.message ?? body?.detail ?? '';
    code = body?.error?.code ?? null;
  } catch {
    message = response.statusText;
  }
  return new ApiError(response.status, explain(response.status, message, code), code);
}

/**
 * createApi({onUnreachable, onReachable}): onUnreachable(error) is called when
 * a call cannot reach the server at all, onReachable() when one does again.
 */
export function createApi({ onUnreachable = () => {}, onReachable = () => {} } = {}) {
  let reachable = true;

  function key() {
    return sessionStorage.getItem(KEY_ITEM) ?? localStorage.getItem(KEY_ITEM) ?? '';
  }

  /** remember: keep it in localStorage (survives the browser), else sessionStorage (this tab). */
  function setKey(value, remember) {
    forgetKey();
    if (value) (remember ? localStorage : sessionStorage).setItem(KEY_ITEM, value);
  }

  function forgetKey() {
    sessionStorage.removeItem(KEY_ITEM);
    localStorage.removeItem(KEY_ITEM);
  }

  function remembered() {
    return localStorage.getItem(KEY_ITEM) !== null;
  }

  function headers(extra = {}) {
    const out = { ...extra };
    const k = key();
    if (k) out.Authorization = `Bearer ${k}`;
    return out;
  }

  async function send(path, { method = 'GET', body, signal, headers: extra } = {}) {
    const init = { method, signal, headers: headers(extra), cache: 'no-store' };
    if (body !== undefined) {
      init.body = JSON.stringify(body);
      init.headers['Content-Type'] = 'application/json';
    }
    let response;
    try {
      response = await fetch(path, init);
    } catch (err) {
      if (err.name === 'AbortError') throw err;
      // The caller's own time limit (AbortSignal.timeout): the server is there but slow, not gone.
      if (err.name === 'TimeoutError') throw new ApiError(408, 'The server did not answer in time: it may be busy.');
      const error = new ApiError(0, 'The server cannot be reached: it may be restarting.');
      if (reachable) {
        reachable = false;
        onUnreachable(error);
      }
      throw error;
    }
    if (!reachable) {
      reachable = true;
      onReachable();
    }
    if (!response.ok) throw await errorFrom(response);
    return response;
  }

  /** fetchJSON(path, {method, body, signal}): the parsed answer, or an ApiError with a readable message. */
  async function fetchJSON(path, opts = {}) {
    const response = await send(path, opts);
    const text = await response.text();
    return text ? JSON.parse(text) : null;
  }

  /**
   * stream(path, body, onEvent, {signal}): POST body with stream semantics and call
   * onEvent({event, data}) for each server-sent event; data is parsed JSON when it
   * is JSON, else the raw text. Resolves when the stream ends ("[DONE]" or close).
   */
  async function stream(path, body, onEvent, { signal } = {}) {
    const response = await send(path, { method: 'POST', body, signal, headers: { Accept: 'text/event-stream' } });
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = '';
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value.replace(/\r\n?/g, '\n');
      let end;
      while ((end = buffer.indexOf('\n\n')) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let event = 'message';
        const lines = [];
        for (const line of block.split('\n')) {
          if (line.startsWith('event:')) event = line.slice(6).trim();
          else if (line.startsWith('data:')) lines.push(line.slice(5).replace(/^ /, ''));
        }
        if (!lines.length) continue;
        const raw = lines.join('\n');
        if (raw === '[DONE]') return;
        let data = raw;
        try {
          data = JSON.parse(raw);
        } catch {
          // not JSON: handed on as text
        }
        onEvent({ event, data });
      }
    }
  }

  /** Whether /health answers: used to notice the server is back. */
  async function alive() {
    try {
      const response = await fetch('/health', { cache: 'no-store' });
      return response.ok;
    } catch {
      return false;
    }
  }

  return { key, setKey, forgetKey, remembered, headers, fetchJSON, stream, alive };
}
