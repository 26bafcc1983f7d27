// answer: one assistant answer on the chat page — `AnswerView` takes the stream's deltas (reasoning, content,
// tool calls), the finish reason and the final usage, and shows them: the reasoning folded in a <details>,
// the content as Markdown, each tool call as a named box with its JSON arguments, and a stats line (tokens,
// time to first token, tokens per second, MTP acceptance and tokens per round, prefix-cache tokens reused).
// It knows nothing of HTTP: app.js feeds it, and the browser test feeds it canned deltas.

import { renderMarkdown } from "./markdown.js";

const RENDER_MS = 40;      // re-render at most this often: each render re-parses the whole answer

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function stat(name, label, value, title) {
  const span = el("span", "stat", label ? `${label} ${value}` : value);
  span.dataset.stat = name;
  if (title) span.title = title;
  return span;
}

function seconds(s) {
  return s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`;
}

export class AnswerView {
  constructor(parent, now = performance.now()) {
    this.el = el("article", "msg assistant");
    this.el.dataset.state = "waiting";
    this.reasoningBox = el("details", "reasoning");
    this.reasoningBox.hidden = true;
    this.reasoningTitle = el("summary", "", "Reasoning");
    this.reasoningText = el("div", "reasoning-text");
    this.reasoningBox.append(this.reasoningTitle, this.reasoningText);
    this.body = el("div", "md content");
    this.body.append(el("span", "cursor", "…"));
    this.toolsBox = el("div", "tool-calls");
    this.errorBox = el("div", "error");
    this.errorBox.setAttribute("role", "alert");
    this.errorBox.hidden = true;
    this.statsBox = el("div", "stats");
    this.el.append(this.reasoningBox, this.body, this.toolsBox, this.errorBox, this.statsBox);
    parent.append(this.el);
    this.reasoning = "";
    this.content = "";
    this.calls = [];                 // by the stream's tool-call index: {id, name, arguments, node}
    this.finishReason = null;
    this.usage = null;
    this.tStart = now;
    this.tFirst = null;
    this.tLast = null;
    this.pending = null;
  }

  get state() { return this.el.dataset.state; }

  apply(delta, now = performance.now()) {
    const reasoning = delta.reasoning_content ?? delta.reasoning;
    const got = Boolean(reasoning || delta.content || delta.tool_calls);
    if (got) {
      if (this.tFirst === null) this.tFirst = now;
      this.tLast = now;
      this.el.dataset.state = "streaming";
    }
    if (reasoning) this.reasoning += reasoning;
    if (delta.content) this.content += delta.content;
    for (const call of delta.tool_calls || []) this.toolCall(call);
    if (got) this.schedule();
  }

  toolCall(part) {
    let call = this.calls[part.index];
    if (!call) {
      call = this.calls[part.index] = { id: part.id, name: "", arguments: "", node: el("div", "tool-call") };
      call.title = el("div", "tool-title");
      call.args = el("pre", "tool-args");
      call.node.append(call.title, call.args);
      this.toolsBox.append(call.node);
    }
    if (part.function?.name) call.name += part.function.name;
    if (part.function?.arguments) call.arguments += part.function.arguments;
  }

  schedule() {
    if (this.pending === null) this.pending = setTimeout(() => this.render(), RENDER_MS);
  }

  render() {
    clearTimeout(this.pending);
    this.pending = null;
    if (this.reasoning) {
      this.reasoningBox.hidden = false;
      const words = this.reasoning.trim().split(/\s+/).length;
      this.reasoningTitle.textContent = this.state === "streaming" && !this.content && !this.calls.length
        ? `Reasoning… (${words} words)` : `Reasoning (${words} words)`;
      this.reasoningText.textContent = this.reasoning.trim();
    }
    renderMarkdown(this.content, this.body);
    if (this.state === "streaming") this.body.append(el("span", "cursor", "▍"));
    for (const call of this.calls.filter(Boolean)) {
      call.title.replaceChildren(el("span", "tool-badge", "tool call"), el("code", "", call.name || "…"));
      let args = call.arguments;
      try { args = JSON.stringify(JSON.parse(args), null, 2); } catch { /* still streaming: show it raw */ }
      call.args.textContent = args;
    }
  }

  finish(reason) { this.finishReason = reason; }

  setUsage(usage) { this.usage = usage; }

  end(state, message) {
    this.el.dataset.state = state;                 // done | stopped | error
    if (message) {
      this.errorBox.textContent = message;
      this.errorBox.hidden = false;
    }
    this.render();
    if (!this.content && !this.reasoning && !this.calls.length) this.body.replaceChildren();
    this.renderStats(performance.now());
  }

  renderStats(now) {
    const parts = [];
    const u = this.usage;
    const ttft = this.tFirst === null ? null : (this.tFirst - this.tStart) / 1000;
    if (u) {
      parts.push(stat("tokens", "tokens", u.completion_tokens, `prompt ${u.prompt_tokens} tokens`));
    } else if (this.state === "stopped") {
      parts.push(stat("stopped", "stopped after", seconds((now - this.tStart) / 1000)));
    }
    if (ttft !== null) {
      parts.push(stat("ttft", "TTFT", seconds(ttft), "request sent → first token, as this page saw it"));
    }
    const n = u?.ninfer;
    const rate = n?.decode_tok_s ?? (u && this.tLast > this.tFirst
      ? (u.completion_tokens - 1) / ((this.tLast - this.tFirst) / 1000) : null);
    if (rate) parts.push(stat("speed", "", `${rate.toFixed(1)} tok/s`, "decode speed after the first token"));
    if (n && n.drafted > 0) {
      parts.push(stat("acceptance", "MTP acceptance", `${(100 * n.acceptance).toFixed(0)}%`,
        `${n.accepted} of ${n.drafted} drafted tokens accepted`));
      parts.push(stat("per-round", "", `${n.tokens_per_round.toFixed(2)} tok/round`, `${n.rounds} decode rounds`));
    } else if (n) {
      parts.push(stat("acceptance", "MTP", "off", "the server runs without draft tokens (serve --draft K)"));
    }
    if (u) {
      const cached = u.prompt_tokens_details?.cached_tokens ?? 0;
      const reused = stat("cached", "prefix cache", `${cached}/${u.prompt_tokens} prompt tokens reused`);
      reused.dataset.value = cached;
      parts.push(reused);
    }
    if (this.finishReason === "length") parts.push(stat("finish", "", "cut at max tokens"));
    this.statsBox.replaceChildren(...parts);
  }

  // The answer as the conversation's next assistant message (what was shown, even if stopped early; a tool
  // call cut off before its arguments closed is left out: the server would refuse its broken JSON).
  message() {
    const whole = (c) => { try { return JSON.parse(c.arguments || "{}") instanceof Object; } catch { return false; } };
    const calls = this.calls.filter((c) => c && whole(c)).map((c) => ({ id: c.id, type: "function",
      function: { name: c.name, arguments: c.arguments || "{}" } }));
    if (!this.content && !calls.length) return null;
    const msg = { role: "assistant", content: this.content };
    if (calls.length) msg.tool_calls = calls;
    return msg;
  }
}
