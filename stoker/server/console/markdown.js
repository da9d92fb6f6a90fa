// Markdown from a model, rendered as DOM nodes built with createElement and
// textContent only: model text never reaches an HTML parser, so `<script>` or
// `<img onerror>` in a reply is shown as the characters it is. Links keep only
// http(s) and mailto targets; anything else (javascript:, data:, relative
// paths) stays as its source text. Images are never loaded from a reply: they
// become a text link to their address, so a reply cannot make the browser
// fetch anything by being shown.

const SAFE_PROTOCOLS = new Set(['http:', 'https:', 'mailto:']);

/** The link target as the browser would follow it, or null where it is not http(s) or mailto. */
export function safeHref(raw) {
  let url;
  try {
    url = new URL(raw.trim());
  } catch {
    return null; // relative or malformed: never resolved against the console's own origin
  }
  return SAFE_PROTOCOLS.has(url.protocol) ? url.href : null;
}

// One alternation, tried left to right at each position; the first group that matched names the span.
// Every span and address has a length bound, so a hostile line costs at most its length times that bound.
const INLINE = new RegExp(
  [
    /(?<code>`{1,16})(?<codeText>[^]{0,2000}?[^`])\k<code>(?!`)/,
    /!\[(?<imgAlt>[^\]]{0,500})\]\((?<imgUrl>[^)\s]{0,2048})(?:\s+"[^"]{0,500}")?\)/,
    /\[(?<linkText>[^\]]{1,500})\]\((?<linkUrl>[^)\s]{0,2048})(?:\s+"[^"]{0,500}")?\)/,
    /<(?<autolink>(?:https?:\/\/|mailto:)[^\s>]{1,2048})>/,
    /(?<bare>https?:\/\/[^\s<]{0,2047}[^\s<.,;:!?)\]'"])/,
    /\*\*(?<strong>[^*\s](?:[^]{0,1000}?[^*\s])?)\*\*/,
    /__(?<strongU>[^_\s](?:[^]{0,1000}?[^_\s])?)__(?!\w)/,
    /~~(?<del>[^~\s](?:[^]{0,1000}?[^~\s])?)~~/,
    /\*(?<em>[^*\s](?:[^*]{0,1000}?[^*\s])?)\*/,
    /(?<!\w)_(?<emU>[^_\s](?:[^_]{0,1000}?[^_\s])?)_(?!\w)/,
    /\\(?<escaped>[\\`*_{}[\]()#+\-.!~|>])/,
  ]
    .map((part) => part.source)
    .join('|'),
  'g',
);
/** A line longer than this is shown as plain text: markdown in it would cost too much to find. */
const MAX_INLINE_CHARS = 20_000;

function element(tag, text) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  return node;
}

function link(href, text) {
  const a = element('a', text);
  a.href = href;
  a.rel = 'noopener noreferrer nofollow';
  a.target = '_blank';
  return a;
}

/** Inline markdown of text appended to parent: code, emphasis, links; everything else as text. */
export function renderInline(text, parent) {
  if (text.length > MAX_INLINE_CHARS) {
    parent.append(text);
    return;
  }
  let last = 0;
  INLINE.lastIndex = 0;
  for (const match of text.matchAll(INLINE)) {
    if (match.index > last) parent.append(text.slice(last, match.index));
    last = match.index + match[0].length;
    const g = match.groups;
    if (g.code !== undefined) {
      parent.append(element('code', g.codeText.replace(/^ (.*) $/s, '$1')));
    } else if (g.imgUrl !== undefined) {
      const href = safeHref(g.imgUrl);
      const label = `image: ${g.imgAlt || g.imgUrl}`;
      parent.append(href ? link(href, label) : match[0]);
    } else if (g.linkUrl !== undefined) {
      const href = safeHref(g.linkUrl);
      if (href) {
        const a = link(href, '');
        renderInline(g.linkText, a);
        parent.append(a);
      } else {
        parent.append(match[0]);
      }
    } else if (g.autolink !== undefined || g.bare !== undefined) {
      const raw = g.autolink ?? g.bare;
      const href = safeHref(raw);
      parent.append(href ? link(href, raw) : match[0]);
    } else if (g.strong !== undefined || g.strongU !== undefined) {
      const node = element('strong');
      renderInline(g.strong ?? g.strongU, node);
      parent.append(node);
    } else if (g.del !== undefined) {
      const node = element('del');
      renderInline(g.del, node);
      parent.append(node);
    } else if (g.em !== undefined || g.emU !== undefined) {
      const node = element('em');
      renderInline(g.em ?? g.emU, node);
      parent.append(node);
    } else {
      parent.append(g.escaped);
    }
  }
  if (last < text.length) parent.append(text.slice(last));
}

/** Lines joined by line breaks: a model's single newline is meant as one. */
function renderLines(lines, parent) {
  lines.forEach((line, i) => {
    if (i > 0) parent.append(element('br'));
    renderInline(line, parent);
  });
}

// Block patterns are matched against one line each; none may backtrack more than linearly,
// as a model's line can be long (the heading's closing #s and the table's rule are done by hand).
const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^ {0,3}(#{1,6})[ \t]+(.*)$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const RULE_CELL = /^:?-+:?$/;

/** A heading's text without the closing #s markdown allows after it. */
function headingText(raw) {
  const text = raw.trimEnd();
  let end = text.length;
  while (end > 0 && text[end - 1] === '#') end -= 1;
  return end === 0 || /\s/.test(text[end - 1]) ? text.slice(0, end).trimEnd() : text;
}

/** Whether line is a table's header rule: |---|:-:| and the like. */
function isTableRule(line) {
  return line.includes('-') && cells(line).every((cell) => RULE_CELL.test(cell));
}

function cells(row) {
  return row
    .trim()
    .replace(/^\||\|$/g, '')
    .split(/(?<!\\)\|/)
    .map((cell) => cell.trim());
}

function renderTable(header, rows, parent) {
  const table = element('table');
  const head = element('thead');
  const headRow = element('tr');
  for (const cell of cells(header)) {
    const th = element('th');
    th.scope = 'col';
    renderInline(cell, th);
    headRow.append(th);
  }
  head.append(headRow);
  const body = element('tbody');
  for (const row of rows) {
    const tr = element('tr');
    for (const cell of cells(row)) {
      const td = element('td');
      renderInline(cell, td);
      tr.append(td);
    }
    body.append(tr);
  }
  table.append(head, body);
  const wrap = element('div');
  wrap.className = 'md-table';
  wrap.append(table);
  parent.append(wrap);
}

function renderCode(language, lines, parent) {
  const pre = element('pre');
  const code = element('code', lines.join('\n'));
  if (language) {
    code.dataset.language = language;
    pre.dataset.language = language;
  }
  pre.append(code);
  parent.append(pre);
}

function renderList(lines, start, parent) {
  const first = ITEM.exec(lines[start]);
  const ordered = /\d/.test(first[2]);
  const list = element(ordered ? 'ol' : 'ul');
  if (ordered && parseInt(first[2], 10) !== 1) list.start = parseInt(first[2], 10);
  const indent = first[1].length;
  let i = start;
  let item = null;
  let body = [];
  const flush = () => {
    if (item) {
      renderBlocks(body, item, true);
      list.append(item);
    }
  };
  while (i < lines.length) {
    const line = lines[i];
    const m = ITEM.exec(line);
    if (m && m[1].length <= indent + 1 && /\d/.test(m[2]) === ordered) {
      flush();
      item = element('li');
      body = [m[3]];
    } else if (line.trim() === '') {
      if (i + 1 >= lines.length || !/^\s/.test(lines[i + 1]) || ITEM.exec(lines[i + 1]) === null) break;
      body.push('');
    } else if (/^\s/.test(line) || (!m && body.length && !isBlockStart(line))) {
      body.push(line.replace(/^ {1,4}/, ''));
    } else {
      break;
    }
    i += 1;
  }
  flush();
  parent.append(list);
  return i;
}

function isBlockStart(line) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line);
}

/** Block markdown of lines appended to parent; tight: a list item's text without a paragraph around it. */
function renderBlocks(lines, parent, tight = false) {
  let i = 0;
  let paragraph = [];
  const endParagraph = () => {
    if (!paragraph.length) return;
    const target = tight ? parent : element('p');
    renderLines(paragraph, target);
    if (!tight) parent.append(target);
    paragraph = [];
  };
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = FENCE.exec(line))) {
      endParagraph();
      const fence = m[1];
      const body = [];
      i += 1;
      // An unclosed fence (a reply still streaming) runs to the end.
      while (i < lines.length && !lines[i].trim().startsWith(fence)) body.push(lines[i++]);
      renderCode(m[2], body, parent);
      i += 1;
    } else if ((m = HEADING.exec(line))) {
      endParagraph();
      // The page holds the h1 and h2s: a reply's headings sit below them in the outline.
      const level = Math.min(6, m[1].length + 2);
      const heading = element(`h${level}`);
      renderInline(headingText(m[2]), heading);
      parent.append(heading);
      i += 1;
    } else if (RULE.test(line)) {
      endParagraph();
      parent.append(element('hr'));
      i += 1;
    } else if (QUOTE.test(line)) {
      endParagraph();
      const quoted = [];
      while (i < lines.length && (m = QUOTE.exec(lines[i]))) {
        quoted.push(m[1]);
        i += 1;
      }
      const quote = element('blockquote');
      renderBlocks(quoted, quote);
      parent.append(quote);
    } else if (ITEM.test(line)) {
      endParagraph();
      i = renderList(lines, i, parent);
    } else if (line.includes('|') && i + 1 < lines.length && isTableRule(lines[i + 1])) {
      endParagraph();
      const rows = [];
      i += 2;
      while (i < lines.length && lines[i].includes('|') && lines[i].trim() !== '') rows.push(lines[i++]);
      renderTable(line, rows, parent);
    } else if (line.trim() === '') {
      endParagraph();
      if (tight && i + 1 < lines.length) tight = false; // a loose list item: its parts become paragraphs
      i += 1;
    } else {
      paragraph.push(line);
      i += 1;
    }
  }
  endParagraph();
}

/** text rendered as markdown into a new DocumentFragment. */
export function renderMarkdown(text) {
  const fragment = document.createDocumentFragment();
  renderBlocks(String(text).replace(/\r\n?/g, '\n').split('\n'), fragment);
  return fragment;
}
