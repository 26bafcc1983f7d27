// app: the chat page's wiring — the conversation (user turns and AnswerViews), the composer with send and
// stop (stop aborts the fetch; the server sees the connection close and frees the lane), new chat, the
// settings sent with each request (system prompt, temperature, max tokens, reasoning on/off), the API key
// panel shown when /v1 answers 401, and the status strip. Images (attach.js) are offered only when /v1/models
// says the model takes them; a message's images go with it and are sent again with every later turn (the server
// keeps no conversation). A message the server refuses goes back to the composer, text and images.

import { AnswerView } from "./answer.js";
import { Api, ApiError, explain } from "./api.js";
import { Attachments, thumbnails, userMessage } from "./attach.js";
import { StatusStrip } from "./status.js";

const $ = (id) => document.getElementById(id);
const api = new Api();
const status = new StatusStrip($("status"), api);
const attachments = new Attachments({ zone: $("composer"), list: $("attachments"), error: $("attach-error"),
  button: $("attach"), input: $("files") });
const page = {
  model: null,             // the served model's id, from /v1/models
  history: [],             // the conversation as sent back to the server (no system prompt)
  chat: 0,                 // which conversation: an answer stopped by "new chat" must not land in the next one
  running: null,           // {view, controller} of the answer being streamed
};

function addUser(text, images) {
  $("empty").hidden = true;
  const msg = document.createElement("article");
  msg.className = "msg user";
  if (images.length) msg.append(thumbnails(images));
  if (text) msg.append(text);            // plain text, as typed
  $("conversation").append(msg);
  return msg;
}

function scrollDown(force) {
  const box = $("conversation");
  // follow the answer only while the reader is at the bottom: scrolling up to read must not be undone
  if (force || box.scrollHeight - box.scrollTop - box.clientHeight < 80) box.scrollTop = box.scrollHeight;
}

function setRunning(running) {
  $("send").hidden = running;
  $("stop").hidden = !running;
  $("prompt").readOnly = running;
}

function requestBody(messages) {
  const body = { model: page.model, messages, stream: true, stream_options: { include_usage: true } };
  const temperature = parseFloat($("temperature").value);
  if (!Number.isNaN(temperature)) body.temperature = temperature;
  const maxTokens = parseInt($("max-tokens").value, 10);
  if (maxTokens > 0) body.max_tokens = maxTokens;
  const thinking = $("thinking").value;
  if (thinking) body.chat_template_kwargs = { enable_thinking: thinking === "on" };
  return body;
}

async function send() {
  if (page.running) return;
  await attachments.ready;               // files still being read belong to this message
  const text = $("prompt").value.trim();
  if ((!text && !attachments.images.length) || page.running) return;
  if (page.model === null && !(await loadModel())) return;
  const images = attachments.take();
  const user = userMessage(text, images);
  const system = $("system").value.trim();
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...page.history, user];
  $("prompt").value = "";
  const bubble = addUser(text, images);
  const chat = page.chat;
  const view = new AnswerView($("conversation"));
  const controller = new AbortController();
  page.running = { view, controller };
  setRunning(true);
  scrollDown(true);
  let state = "done";
  let message;
  try {
    for await (const chunk of api.chat(requestBody(messages), controller.signal)) {
      const choice = chunk.choices?.[0];
      if (choice) {
        view.apply(choice.delta || {});
        if (choice.finish_reason) view.finish(choice.finish_reason);
      }
      if (chunk.usage) view.setUsage(chunk.usage);
      scrollDown(false);
    }
  } catch (err) {
    if (err.name === "AbortError") {
      state = "stopped";
    } else {
      state = "error";
      message = explain(err);
      if (err instanceof ApiError && err.status === 401) askKey(message);
    }
  }
  if (state === "error" && chat === page.chat) {
    // nothing is lost: the refused message goes back to the composer, to be fixed (an image removed) and resent
    bubble.dataset.state = "refused";
    if (!$("prompt").value) $("prompt").value = text;
    attachments.restore(images);
    message = `${message.replace(/[.\s]*$/, ".")} Your message${images.length ? " and its images are" : " is"} ` +
      "back in the composer.";
  }
  view.end(state, message);
  if (state !== "error" && chat === page.chat) {
    const answer = view.message();
    page.history.push(user, ...(answer ? [answer] : []));
  }
  page.running = null;
  setRunning(false);
  scrollDown(false);
  $("prompt").focus();
}

function stop() {
  page.running?.controller.abort();
}

function newChat() {
  stop();
  page.chat += 1;
  page.history = [];
  $("conversation").replaceChildren($("empty"));
  $("empty").hidden = false;
  $("prompt").value = "";
  attachments.take();
  $("prompt").focus();
}

function askKey(message) {
  $("key-panel").hidden = false;
  $("key-error").textContent = message || "";
  $("key").focus();
}

// Reads the served model; false (and the key panel shown, or the reason in the strip) when it cannot.
async function loadModel() {
  try {
    const models = await api.json("/v1/models");
    page.model = models.data[0].id;
    status.model(models.data[0]);
    const vision = models.data[0].capabilities?.vision === true;
    attachments.enable(vision);
    $("vision-note").textContent = vision
      ? "Images: attach, paste or drop PNG, JPEG, WebP, GIF or BMP files (up to 20 MiB each)."
      : "Text only: this model takes no images.";
    $("key-panel").hidden = true;
    $("key-error").textContent = "";
    return true;
  } catch (err) {
    if (err instanceof ApiError && err.status === 401) askKey(api.key ? explain(err) : "");
    else status.set("model", explain(err));
    return false;
  }
}

function wire() {
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); send(); }
    if (e.key === "Escape") stop();
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  $("key-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const key = $("key").value.trim();
    if (!key) return;
    api.setKey(key);
    $("key-error").textContent = "Checking the key…";
    if (await loadModel()) $("prompt").focus();
  });
}

wire();
status.start();
loadModel();
