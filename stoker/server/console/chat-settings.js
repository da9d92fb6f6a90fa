// The playground's settings form: the model and the sampling fields of a chat
// request, a JSON schema for structured output and tool definitions. Each field
// is checked here before a request goes out, with the bounds the server itself
// enforces (stoker/server/protocol.py), and a wrong one is named beside it.

import { h, replace } from './dom.js';

export const DEFAULTS = Object.freeze({
  model: '',
  system: '',
  temperature: 0.7,
  top_p: 1,
  max_tokens: 256,
  seed: null,
  stop: '',
  logprobs: false,
  top_logprobs: 0,
  schema: '',
  tools: '',
  tool_choice: 'auto',
});

const INT32 = 2 ** 31 - 1;
const TOOL_NAME = /^[a-zA-Z0-9_-]{1,64}$/;
const MAX_STOP_STRINGS = 64;
const MAX_TOOLS = 128;
const MAX_TOP_LOGPROBS = 20;

class FieldError extends Error {
  constructor(field, message) {
    super(message);
    this.field = field;
  }
}

function number(field, value, { min, max, integer, above }) {
  if (value === null || value === undefined || value === '') return null;
  const n = Number(value);
  if (!Number.isFinite(n)) throw new FieldError(field, 'must be a number');
  if (integer && !Number.isInteger(n)) throw new FieldError(field, 'must be a whole number');
  if (above !== undefined && n <= above) throw new FieldError(field, `must be above ${above}`);
  if (min !== undefined && n < min) throw new FieldError(field, `must be at least ${min}`);
  if (max !== undefined && n > max) throw new FieldError(field, `must be at most ${max}`);
  return n;
}

function parseJSON(field, text) {
  try {
    return JSON.parse(text);
  } catch (error) {
    throw new FieldError(field, `is not valid JSON: ${error.message}`);
  }
}

/** A tools box's text as OpenAI's `tools`: a list of {type: "function", function: {name, ...}} (bare functions are wrapped). */
export function parseTools(text) {
  const tools = parseJSON('tools', text);
  if (!Array.isArray(tools)) throw new FieldError('tools', 'must be a JSON list of tool definitions');
  if (tools.length > MAX_TOOLS) throw new FieldError('tools', `holds ${tools.length} tools; at most ${MAX_TOOLS}`);
  return tools.map((tool, i) => {
    const wrapped = tool && typeof tool === 'object' && tool.type === undefined && 'name' in tool ? { type: 'function', function: tool } : tool;
    if (!wrapped || typeof wrapped !== 'object' || wrapped.type !== 'function' || typeof wrapped.function !== 'object' || wrapped.function === null) {
      throw new FieldError('tools', `tool ${i + 1} must be {"type": "function", "function": {"name": ..., "parameters": {...}}}`);
    }
    if (typeof wrapped.function.name !== 'string' || !TOOL_NAME.test(wrapped.function.name)) {
      throw new FieldError('tools', `tool ${i + 1}'s name must be 1 to 64 letters, digits, _ or -`);
    }
    const params = wrapped.function.parameters;
    if (params !== undefined && (params === null || typeof params !== 'object' || Array.isArray(params))) {
      throw new FieldError('tools', `tool ${i + 1}'s parameters must be a JSON schema object`);
    }
    return wrapped;
  });
}

/** The stop box: one string a line; \n and \t written out stand for a newline and a tab. */
export function parseStops(text) {
  const stops = text.split('\n').filter((line) => line !== '').map((line) => line.replace(/\\n/g, '\n').replace(/\\t/g, '\t'));
  if (stops.length > MAX_STOP_STRINGS) throw new FieldError('stop', `holds ${stops.length} strings; at most ${MAX_STOP_STRINGS}`);
  return stops;
}

/** The request fields the settings give (everything but messages and stream), or a FieldError naming the wrong one. */
export function requestFields(s) {
  const out = { model: s.model };
  if (!s.model) throw new FieldError('model', 'no chat model to send to: the model list is empty or could not be loaded');
  const temperature = number('temperature', s.temperature, { min: 0, max: 2 });
  if (temperature !== null) out.temperature = temperature;
  const topP = number('top_p', s.top_p, { above: 0, max: 1 });
  if (topP !== null) out.top_p = topP;
  const maxTokens = number('max_tokens', s.max_tokens, { min: 1, max: INT32, integer: true });
  if (maxTokens !== null) out.max_tokens = maxTokens;
  // The server takes 64-bit seeds, but a browser's numbers hold whole numbers exactly only this far.
  const seed = number('seed', s.seed, { min: -Number.MAX_SAFE_INTEGER, max: Number.MAX_SAFE_INTEGER, integer: true });
  if (seed !== null) out.seed = seed;
  const stops = parseStops(s.stop);
  if (stops.length) out.stop = stops;
  if (s.logprobs) {
    out.logprobs = true;
    const top = number('top_logprobs', s.top_logprobs, { min: 0, max: MAX_TOP_LOGPROBS, integer: true });
    if (top) out.top_logprobs = top;
  }
  if (s.schema.trim()) {
    const schema = parseJSON('schema', s.schema);
    if (!schema || typeof schema !== 'object' || Array.isArray(schema)) throw new FieldError('schema', 'must be a JSON object (a JSON schema)');
    out.response_format = { type: 'json_schema', json_schema: { name: 'reply', schema, strict: true } };
  }
  if (s.tools.trim()) {
    out.tools = parseTools(s.tools);
    out.tool_choice = s.tool_choice;
  }
  return out;
}

const LABELS = {
  model: 'Model',
  system: 'System prompt',
  temperature: 'Temperature (0–2)',
  top_p: 'Top p (above 0, up to 1)',
  max_tokens: 'Max tokens',
  seed: 'Seed (empty: random)',
  stop: 'Stop strings (one a line; \\n is a newline)',
  logprobs: 'Logprobs (token view)',
  top_logprobs: 'Top logprobs (0–20)',
  schema: 'JSON schema (structured output)',
  tools: 'Tools (JSON list of function definitions)',
  tool_choice: 'Tool choice',
};

/** The form; onChange() runs after any edit. Returns {element, read, write, setModels, check}. */
export function createSettings(onChange) {
  const inputs = {
    model: h('select', { id: 'pg-model' }),
    system: h('textarea', { id: 'pg-system', rows: '3' }),
    temperature: h('input', { id: 'pg-temperature', type: 'number', min: '0', max: '2', step: '0.1', inputmode: 'decimal' }),
    top_p: h('input', { id: 'pg-top_p', type: 'number', min: '0', max: '1', step: '0.05', inputmode: 'decimal' }),
    max_tokens: h('input', { id: 'pg-max_tokens', type: 'number', min: '1', step: '1', inputmode: 'numeric' }),
    seed: h('input', { id: 'pg-seed', type: 'number', step: '1', inputmode: 'numeric' }),
    stop: h('textarea', { id: 'pg-stop', rows: '2', spellcheck: 'false' }),
    logprobs: h('input', { id: 'pg-logprobs', type: 'checkbox' }),
    top_logprobs: h('input', { id: 'pg-top_logprobs', type: 'number', min: '0', max: '20', step: '1', inputmode: 'numeric' }),
    schema: h('textarea', { id: 'pg-schema', rows: '5', spellcheck: 'false', placeholder: '{"type": "object", "properties": {...}}' }),
    tools: h('textarea', { id: 'pg-tools', rows: '5', spellcheck: 'false', placeholder: '[{"type": "function", "function": {"name": "get_weather", "parameters": {...}}}]' }),
    tool_choice: h('select', { id: 'pg-tool_choice' },
      h('option', { value: 'auto' }, 'auto: the model decides'),
      h('option', { value: 'required' }, 'required: a call'),
      h('option', { value: 'none' }, 'none: no call')),
  };
  const errors = {};
  const modelNote = h('p', { class: 'pg-note', id: 'pg-model-note', role: 'status' });

  function row(name) {
    errors[name] = h('p', { class: 'field-error', id: `pg-${name}-error`, hidden: true });
    const input = inputs[name];
    input.setAttribute('aria-describedby', `pg-${name}-error`);
    input.addEventListener('input', () => {
      clear(name);
      onChange();
    });
    const label = h('label', { for: input.id }, LABELS[name]);
    return h('div', { class: input.type === 'checkbox' ? 'field check' : 'field' }, input.type === 'checkbox' ? [input, label] : [label, input], errors[name]);
  }

  function clear(name) {
    errors[name].hidden = true;
    replace(errors[name]);
    inputs[name].removeAttribute('aria-invalid');
  }

  const element = h('form', { class: 'pg-settings', 'aria-labelledby': 'pg-settings-title', onsubmit: (e) => e.preventDefault() },
    h('h2', { id: 'pg-settings-title' }, 'Settings'),
    row('model'), modelNote, row('system'),
    h('div', { class: 'field-grid' }, row('temperature'), row('top_p'), row('max_tokens'), row('seed')),
    row('stop'), row('logprobs'), row('top_logprobs'),
    h('details', { class: 'pg-advanced' }, h('summary', {}, 'Structured output and tools'), row('schema'), row('tools'), row('tool_choice')));

  function read() {
    const s = {};
    for (const [name, input] of Object.entries(inputs)) {
      if (input.type === 'checkbox') s[name] = input.checked;
      else if (input.type === 'number') s[name] = input.value === '' ? null : Number(input.value);
      else s[name] = input.value;
    }
    return s;
  }

  function write(settings) {
    const s = { ...DEFAULTS, ...settings };
    for (const [name, input] of Object.entries(inputs)) {
      if (name === 'model') continue;
      if (input.type === 'checkbox') input.checked = Boolean(s[name]);
      else input.value = s[name] === null || s[name] === undefined ? '' : String(s[name]);
      clear(name);
    }
    if (s.model && [...inputs.model.options].some((o) => o.value === s.model)) inputs.model.value = s.model;
  }

  /** The chat models to pick from (ids), or an error message when the list could not be had. */
  function setModels(ids, problem) {
    const keep = inputs.model.value;
    replace(inputs.model, ids.map((id) => h('option', { value: id }, id)));
    if (ids.includes(keep)) inputs.model.value = keep;
    replace(modelNote, problem ?? '');
    modelNote.className = problem ? 'pg-note error' : 'pg-note';
    modelNote.setAttribute('role', problem ? 'alert' : 'status');
  }

  /** The request fields, or null after naming the wrong field beside it (and focusing it). */
  function check() {
    for (const name of Object.keys(inputs)) clear(name);
    try {
      for (const [name, input] of Object.entries(inputs)) {
        if (input.validity.badInput) throw new FieldError(name, 'must be a number');
      }
      return requestFields(read());
    } catch (error) {
      if (!(error instanceof FieldError)) throw error;
      const name = error.field;
      replace(errors[name], `${LABELS[name].replace(/ \(.*/, '')}: ${error.message}`);
      errors[name].hidden = false;
      inputs[name].setAttribute('aria-invalid', 'true');
      if (name === 'schema' || name === 'tools' || name === 'tool_choice') element.querySelector('.pg-advanced').open = true;
      inputs[name].focus();
      return null;
    }
  }

  return { element, read, write, setModels, check };
}
