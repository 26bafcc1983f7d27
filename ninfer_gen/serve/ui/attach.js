// attach: the composer's images — the attach button and its file input, paste and drag-and-drop onto the
// composer, a thumbnail with a remove (×) for each image waiting to be sent, and the checks made before
// anything is sent (an image type the server decodes, at most 20 MiB), refusals shown in the page. Images are
// read as data URLs: the page's CSP allows data: images only, and the server takes them as OpenAI image_url
// parts. Decoding is the server's: a file that is no valid image comes back as its 400, shown by app.js.

export const TYPES = ["image/png", "image/jpeg", "image/webp", "image/gif", "image/bmp"];
export const MAX_BYTES = 20 * 2 ** 20;     // the server's own limit per image (vision.preprocess.ImageLimits)

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function readDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

function hasFiles(event) {
  return [...(event.dataTransfer?.types || [])].includes("Files");
}

// Why a file is refused, or null when it may be sent.
function refusal(file) {
  const name = file.name || "the pasted file";
  if (!TYPES.includes(file.type)) return `${name} is not a PNG, JPEG, WebP, GIF or BMP image`;
  if (file.size > MAX_BYTES) return `${name} is ${(file.size / 2 ** 20).toFixed(1)} MiB, over the 20 MiB limit`;
  return null;
}

// A user message: its text, then its images as image_url parts (plain text content when there is no image).
export function userMessage(text, images) {
  if (!images.length) return { role: "user", content: text };
  const parts = images.map((image) => ({ type: "image_url", image_url: { url: image.url } }));
  return { role: "user", content: [...(text ? [{ type: "text", text }] : []), ...parts] };
}

function picture(image) {
  const img = el("img");
  img.src = image.url;
  img.alt = img.title = image.name;
  return img;
}

// The thumbnails of `images` ({name, url}), as the transcript shows a sent message's.
export function thumbnails(images) {
  const box = el("div", "thumbs");
  box.append(...images.map(picture));
  return box;
}

export class Attachments {
  // zone: the element that takes pastes and drops (the composer); list: where thumbnails go; error: the
  // refusal line; button and input: the attach button and its hidden file input.
  constructor({ zone, list, error, button, input }) {
    Object.assign(this, { zone, list, error, button, input });
    this.images = [];                // {name, url} waiting for the next message
    this.enabled = false;            // whether the model takes images (capabilities.vision of /v1/models)
    this.ready = Promise.resolve();  // settles once every file given so far is read
    button.addEventListener("click", () => input.click());
    input.addEventListener("change", () => { this.add([...input.files]); input.value = ""; });
    zone.addEventListener("paste", (e) => {
      const files = [...(e.clipboardData?.files || [])];
      if (files.length) { e.preventDefault(); this.add(files); }
    });
    zone.addEventListener("dragover", (e) => {
      if (hasFiles(e)) { e.preventDefault(); zone.classList.add("dropping"); }
    });
    zone.addEventListener("dragleave", () => zone.classList.remove("dropping"));
    zone.addEventListener("drop", (e) => {
      zone.classList.remove("dropping");
      if (hasFiles(e)) { e.preventDefault(); this.add([...e.dataTransfer.files]); }
    });
    // a file dropped beside the composer must not replace the page (and the conversation) with the file
    for (const type of ["dragover", "drop"]) {
      window.addEventListener(type, (e) => { if (hasFiles(e)) e.preventDefault(); });
    }
  }

  enable(on) {
    this.enabled = on;
    this.button.hidden = !on;
  }

  say(message) {
    this.error.textContent = message;
  }

  add(files) {
    if (!files.length) return this.ready;
    if (!this.enabled) {
      this.say("This model takes text only: it has no vision tower, so images cannot be sent.");
      return this.ready;
    }
    const refused = files.map(refusal).filter(Boolean);
    const accepted = files.filter((file) => !refusal(file));
    this.say(refused.length ? `Not attached: ${refused.join("; ")}.` : "");
    const read = Promise.allSettled(accepted.map(readDataUrl)).then((results) => {
      results.forEach((r, i) => {
        if (r.status === "fulfilled") this.images.push({ name: accepted[i].name || "pasted image", url: r.value });
        else this.say(`Could not read ${accepted[i].name}: ${r.reason?.message || r.reason}.`);
      });
      this.render();
    });
    this.ready = this.ready.then(() => read);
    return this.ready;
  }

  // The images for the message being sent; the composer is left empty.
  take() {
    const images = this.images;
    this.images = [];
    this.say("");
    this.render();
    return images;
  }

  // Images of a message the server did not take, back in the composer (before any attached since).
  restore(images) {
    this.images = [...images, ...this.images];
    this.render();
  }

  render() {
    this.list.replaceChildren(...this.images.map((image, i) => {
      const item = el("div", "thumb");
      const remove = el("button", "remove", "×");
      remove.type = "button";
      remove.title = `Remove ${image.name}`;
      remove.setAttribute("aria-label", remove.title);
      remove.addEventListener("click", () => { this.images.splice(i, 1); this.render(); });
      item.append(picture(image), remove);
      return item;
    }));
  }
}
