// status: the chat page's status strip — polls /health (lanes busy, queue) and /metrics (KV pages, state
// slots, MTP acceptance since start) while the tab is visible, and shows the model's name and context from
// /v1/models (read by app.js, which owns the key). Neither poll is behind the API key.

import { parseMetrics } from "./api.js";

const POLL_MS = 1500;

function field(strip, name) {
  return strip.querySelector(`[data-field="${name}"]`);
}

export class StatusStrip {
  constructor(strip, api) {
    this.strip = strip;
    this.api = api;
    this.timer = null;
  }

  set(name, text, title) {
    const node = field(this.strip, name);
    node.textContent = text;
    if (title !== undefined) node.title = title;
  }

  model(info) {
    this.set("model", info.id, `context ${info.max_model_len} tokens`);
  }

  start() {
    const tick = async () => {
      if (!document.hidden) await this.poll();
      this.timer = setTimeout(tick, POLL_MS);
    };
    tick();
  }

  async poll() {
    const [health, metrics] = await Promise.allSettled([this.api.json("/health"), this.api.text("/metrics")]);
    if (health.status === "rejected") {
      this.strip.dataset.state = "down";
      this.set("server", "server unreachable");
      return;
    }
    const h = health.value;
    this.strip.dataset.state = h.status === "ok" ? (h.lanes_busy ? "busy" : "idle") : "down";
    this.set("server", h.status === "ok" ? (h.lanes_busy ? "generating" : "ready") : `engine ${h.status}`);
    this.set("lanes", `lanes ${h.lanes_busy}/${h.lanes} busy`);
    this.set("queue", `queue ${h.queue_depth}/${h.max_queue}`);
    if (metrics.status === "fulfilled") {
      const m = parseMetrics(metrics.value);
      const pages = m.ninfer_kv_pages;
      this.set("kv", pages ? `KV pages ${m.ninfer_kv_pages_in_use}/${pages}` : "KV pages —",
        "paged KV cache: pages held by running sequences and cached prefixes / pages in the pool");
      const slots = m.ninfer_state_slots;
      this.set("slots", slots ? `state slots ${m.ninfer_state_slots_in_use}/${slots}` : "");
      const drafted = m.ninfer_engine_draft_tokens_total;
      this.set("mtp", drafted ? `MTP acceptance ${(100 * m.ninfer_spec_acceptance_ratio).toFixed(0)}%` : "",
        "accepted / drafted MTP tokens since the server started");
    }
  }
}
