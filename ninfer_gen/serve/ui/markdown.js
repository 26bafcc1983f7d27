// markdown: the chat page's Markdown renderer — `renderMarkdown(text, into)` replaces `into`'s children with
// the rendered text: fenced and indented code blocks (with a language label and a copy button), headings,
// lists (nested by indentation), block quotes, tables, rules, paragraphs; inline code, bold, italic,
// strikethrough, links. It builds DOM nodes and sets text with textContent only, never innerHTML: model
// output is untrusted and must never become markup. An unclosed fence renders as a code block so far,
// because the text is re-rendered as it streams in.

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$/;
const RULE = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const ITEM = /^( *)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_SEP = /^ *\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
const INDENTED = /^(?: {4}|\t)/;

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function codeBlock(code, lang) {
  const box = el("div", "code");
  const head = el("div", "code-head");
  head.append(el("span", "code-lang", lang || "text"));
  const copy = el("button", "code-copy", "Copy");
  copy.type = "button";
  copy.addEventListener("click", () => {
    // the clipboard API exists only in secure contexts (https or localhost): elsewhere say so, do not throw
    const done = (label) => { copy.textContent = label; setTimeout(() => { copy.textContent = "Copy"; }, 1500); };
    if (!navigator.clipboard) return done("no clipboard here");
    navigator.clipboard.writeText(code).then(() => done("Copied"), () => done("copy failed"));
  });
  head.append(copy);
  const pre = el("pre");
  const inner = el("code", lang ? `lang-${lang}` : "", code);
  pre.append(inner);
  box.append(head, pre);
  return box;
}

// Inline rules, tried at every position; the earliest match wins (ties: the first rule listed).
const INLINE = [
  { re: /(`+)([\s\S]*?[^`])\1(?!`)/, make: (m) => el("code", "", m[2].replace(/^ (.*) $/, "$1")) },
  { re: /\[([^\]\n]+)\]\(\s*([^)\s]+)\s*\)/, make: (m) => link(m[2], m[1]) },
  { re: /\bhttps?:\/\/[^\s<>()]*[^\s<>().,;:!?'"*_]/, make: (m) => link(m[0], null) },
  { re: /\*\*(?=\S)([\s\S]*?\S)\*\*/, make: (m) => wrap("strong", m[1]) },
  { re: /(?<!\w)__(?=\S)([\s\S]*?\S)__(?!\w)/, make: (m) => wrap("strong", m[1]) },
  { re: /(?<![\w*])\*(?=[^\s*])([\s\S]*?[^\s*])\*(?![\w*])/, make: (m) => wrap("em", m[1]) },
  { re: /(?<!\w)_(?=[^\s_])([\s\S]*?[^\s_])_(?!\w)/, make: (m) => wrap("em", m[1]) },
  { re: /~~(?=\S)([\s\S]*?\S)~~/, make: (m) => wrap("del", m[1]) },
];

function link(url, label) {
  // only web and mail links: a javascript: or data: URL from the model must not become clickable
  if (!/^(https?:|mailto:)/i.test(url)) return document.createTextNode(label === null ? url : `[${label}](${url})`);
  const a = el("a");
  a.href = url;
  a.target = "_blank";
  a.rel = "noopener noreferrer";
  if (label === null) a.textContent = url;
  else inline(label, a);
  return a;
}

function wrap(tag, inner) {
  const node = el(tag);
  inline(inner, node);
  return node;
}

export function inline(text, into) {
  let rest = text;
  while (rest) {
    let best = null;
    for (const rule of INLINE) {
      const m = rule.re.exec(rest);
      if (m && (best === null || m.index < best.m.index)) best = { m, rule };
    }
    if (best === null) {
      into.append(document.createTextNode(rest));
      return into;
    }
    if (best.m.index > 0) into.append(document.createTextNode(rest.slice(0, best.m.index)));
    into.append(best.rule.make(best.m));
    rest = rest.slice(best.m.index + best.m[0].length);
  }
  return into;
}

function paragraph(lines) {
  // A line break in an answer is meant (code-like text, poems, addresses): keep it, and keep leading
  // indentation visible (as no-break spaces) since this model often writes code without a fence.
  const p = el("p");
  lines.forEach((line, i) => {
    if (i) p.append(el("br"));
    const indent = line.match(/^ */)[0].length;
    inline("\u00a0".repeat(indent) + line.slice(indent), p);
  });
  return p;
}

function cells(line) {
  return line.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map((c) => c.trim());
}

function table(lines) {
  const t = el("table");
  const head = el("tr");
  cells(lines[0]).forEach((c) => head.append(inline(c, el("th"))));
  t.append(el("thead"));
  t.tHead.append(head);
  const body = el("tbody");
  for (const line of lines.slice(2)) {
    const row = el("tr");
    cells(line).forEach((c) => row.append(inline(c, el("td"))));
    body.append(row);
  }
  t.append(body);
  const box = el("div", "table");
  box.append(t);
  return box;
}

function startsBlock(line, next) {
  return FENCE.test(line) || HEADING.test(line) || RULE.test(line) || QUOTE.test(line) || ITEM.test(line) ||
    (line.includes("|") && next !== undefined && TABLE_SEP.test(next) && next.includes("-"));
}

function list(lines, i, into) {
  // items of one list: same marker kind; an item's body is its first line and the lines indented past its marker
  const first = lines[i].match(ITEM);
  const ordered = /\d/.test(first[2]);
  const node = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
  const base = first[1].length;
  while (i < lines.length) {
    const m = lines[i].match(ITEM);
    if (!m || m[1].length !== base || /\d/.test(m[2]) !== ordered) break;
    const width = m[1].length + m[2].length + 1;
    const body = [m[3]];
    i++;
    while (i < lines.length) {
      const line = lines[i];
      const indent = line.match(/^ */)[0].length;
      if (line.trim() === "" && i + 1 < lines.length && lines[i + 1].match(/^ */)[0].length >= width) {
        body.push("");
      } else if (line.trim() !== "" && indent >= Math.min(width, base + 2)) {
        body.push(line.slice(Math.min(indent, width)));
      } else if (line.trim() !== "" && indent > base && !startsBlock(line)) {
        body.push(line.trim());             // a lazy continuation of the item's text
      } else break;
      i++;
    }
    const li = el("li");
    if (body.length === 1) inline(body[0], li);
    else blocks(body, li, true);
    node.append(li);
  }
  into.append(node);
  return i;
}

function blocks(lines, into, tight = false) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if (line.trim() === "") { i++; continue; }
    if ((m = line.match(FENCE))) {
      const close = new RegExp(`^ {0,3}${m[1][0]}{${m[1].length},}\\s*$`);
      const code = [];
      for (i++; i < lines.length && !close.test(lines[i]); i++) code.push(lines[i]);
      i++;                                   // past the closing fence (or the end: still streaming)
      into.append(codeBlock(code.join("\n"), m[2]));
    } else if (INDENTED.test(line) && !tight) {
      const code = [];
      while (i < lines.length && (INDENTED.test(lines[i]) || lines[i].trim() === "")) code.push(lines[i++]);
      while (code.length && code[code.length - 1].trim() === "") code.pop();
      into.append(codeBlock(code.map((l) => l.replace(INDENTED, "")).join("\n"), ""));
    } else if ((m = line.match(HEADING))) {
      into.append(inline(m[2], el(`h${m[1].length}`)));
      i++;
    } else if (RULE.test(line)) {
      into.append(el("hr"));
      i++;
    } else if (QUOTE.test(line)) {
      const inner = [];
      while (i < lines.length && (m = lines[i].match(QUOTE))) { inner.push(m[1]); i++; }
      const quote = el("blockquote");
      blocks(inner, quote);
      into.append(quote);
    } else if (ITEM.test(line)) {
      i = list(lines, i, into);
    } else if (startsBlock(line, lines[i + 1])) {
      const rows = [line, lines[i + 1]];
      for (i += 2; i < lines.length && lines[i].includes("|") && lines[i].trim() !== ""; i++) rows.push(lines[i]);
      into.append(table(rows));
    } else {
      const para = [];
      while (i < lines.length && lines[i].trim() !== "" && !startsBlock(lines[i], lines[i + 1])) para.push(lines[i++]);
      into.append(paragraph(para));
    }
  }
  return into;
}

export function renderMarkdown(text, into) {
  into.replaceChildren();
  return blocks(text.replace(/\r\n?/g, "\n").split("\n"), into);
}
