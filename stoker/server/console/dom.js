// Building the page without innerHTML: every string becomes a text node, so
// nothing a model, a key name or an error message holds can become markup.

/**
 * h('button', {type: 'button', onclick: fn, 'aria-label': 'Revoke'}, 'Revoke')
 * attrs: on* keys are listeners; class, for, aria-*, data-* and the rest are
 * attributes (false/null/undefined leave one out, true sets it empty); `value`
 * and `checked` are set as properties. children: strings, numbers, nodes,
 * arrays of them; null/undefined/false are skipped.
 */
export function h(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith('on') && typeof value === 'function') {
      node.addEventListener(name.slice(2), value);
    } else if (name === 'value' || name === 'checked') {
      node[name] = value;
    } else {
      node.setAttribute(name, value === true ? '' : String(value));
    }
  }
  append(node, children);
  return node;
}

export function append(node, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

/** Replace every child of node with children. */
export function replace(node, ...children) {
  node.replaceChildren();
  return append(node, children);
}

let fieldCount = 0;

/**
 * field('Name', control): the control with its label beside it, not around it
 * (a wrapped input's value or a select's options would join the label's
 * accessible name). Gives the control an id when it has none.
 */
export function field(text, control) {
  if (!control.id) control.id = `field-${++fieldCount}`;
  return h('span', { class: 'field' }, h('label', { for: control.id }, text), control);
}
