// api: the chat page's client of this server — JSON GETs, the streamed chat completion read as server-sent
// events from fetch (EventSource cannot POST or send a key), the API key (kept in sessionStorage: asked once
// per tab, not written to disk beyond the browser's session), and a readable sentence for every failure.
// Every failure is an ApiError the page shows; nothing is left to surface as an uncaught console error.

const KEY_ITEM = "ninfer-gen.api-key";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;          // HTTP status; 0: no answer (network) or an error inside the stream
  }
}

// The message of an error body in OpenAI's or Anthropic's shape, else its text.
async function serverMessage(response) {
  const text = await response.text().catch(() => "");
  try {
    const body = JSON.parse(text);
    return body?.error?.message || text;
  } catch {
    return text.trim() || response.statusText;
  }
}

export function explain(err) {
  if (!(err instanceof ApiError)) return `Unexpected error in the page: ${err?.message || err}`;
  switch (err.status) {
    case 0: return err.message;
    case 401: return `The server refused the API key: ${err.message}`;
    case 429: return `The server is busy (its queue is full): ${err.message}. Try again in a moment.`;
    case 504: return `The answer took longer than the server's request timeout: ${err.message}`;
    default: return `The server answered ${err.status}: ${err.message}`;
  }
}

export class Api {
  constructor() {
    this.key = sessionStorage.getItem(KEY_ITEM) || "";
  }

  setKey(key) {
    this.key = key;
    sessionStorage.setItem(KEY_ITEM, key);
  }

  headers(extra = {}) {
    return this.key ? { ...extra, Authorization: `Bearer ${this.key}` } : extra;
  }

  async request(path, options = {}) {
    let response;
    try {
      response = await fetch(path, { ...options, headers: this.headers(options.headers) });
    } catch (err) {
      if (err.name === "AbortError") throw err;
      throw new ApiError(0, "Cannot reach the server: is `ninfer-gen serve` still running?");
    }
    if (!response.ok) throw new ApiError(response.status, await serverMessage(response));
    return response;
  }

  async json(path) {
    return (await this.request(path)).json();
  }

  async text(path) {
    return (await this.request(path)).text();
  }

  // Yields the stream's chunk objects until `data: [DONE]`; an error event in the stream becomes an ApiError.
  async *chat(body, signal) {
    const response = await this.request("/v1/chat/completions", {
      method: "POST", signal, headers: { "Content-Type": "application/json" }, body: JSON.stringify(body),
    });
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      let part;
      try {
        part = await reader.read();
      } catch (err) {
        if (err.name === "AbortError") throw err;
        throw new ApiError(0, "The connection to the server broke off during the answer.");
      }
      if (part.done) throw new ApiError(0, "The server ended the answer without finishing it.");
      buffer += part.value;
      const events = buffer.split(/\r?\n\r?\n/);
      buffer = events.pop();
      for (const event of events) {
        const data = event.split(/\r?\n/).filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart())
          .join("\n");
        if (!data) continue;
        if (data === "[DONE]") return;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new ApiError(0, `The server failed during the answer: ${chunk.error.message}`);
        yield chunk;
      }
    }
  }
}

// Prometheus text → {metric name (with labels, as written) → number}.
export function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const at = line.lastIndexOf(" ");
    out[line.slice(0, at)] = Number(line.slice(at + 1));
  }
  return out;
}
