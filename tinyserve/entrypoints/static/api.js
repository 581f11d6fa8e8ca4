// The playground's HTTP side: the API key, JSON calls and server-sent events read from a
// fetch() body (EventSource cannot send an Authorization header).
"use strict";

const Api = (() => {
  const KEY = "tinyserve.apiKey";
  let keyWaiters = null; // the pending askKey() promise, shared by every caller that got a 401

  const headers = (extra = {}) => {
    const h = { "Content-Type": "application/json", ...extra };
    const key = localStorage.getItem(KEY);
    if (key) h.Authorization = `Bearer ${key}`;
    return h;
  };

  // Show the key dialog once, however many requests were refused; resolves when saved.
  function askKey() {
    if (keyWaiters) return keyWaiters;
    const dialog = document.getElementById("key-dialog");
    const input = document.getElementById("key-input");
    input.value = "";
    keyWaiters = new Promise((resolve) => {
      dialog.addEventListener("close", () => {
        if (input.value) localStorage.setItem(KEY, input.value);
        keyWaiters = null;
        resolve();
      }, { once: true });
    });
    if (!dialog.open) dialog.showModal();
    input.focus();
    return keyWaiters;
  }

  class HttpError extends Error {
    constructor(status, body) {
      const msg = (body && body.error && body.error.message) || `HTTP ${status}`;
      super(msg);
      this.status = status;
      this.body = body;
    }
  }

  // fetch with the key; on 401 ask for it and retry (up to 3 times).
  async function request(path, { method = "GET", body, signal } = {}) {
    for (let attempt = 0; ; attempt++) {
      const resp = await fetch(path, {
        method, signal, headers: headers(),
        body: body === undefined ? undefined : JSON.stringify(body),
      });
      if (resp.status === 401 && attempt < 3) {
        await askKey();
        continue;
      }
      if (!resp.ok) {
        let err = null;
        try { err = await resp.json(); } catch (_) { /* not JSON */ }
        throw new HttpError(resp.status, err);
      }
      return resp;
    }
  }

  const getJson = async (path) => (await request(path)).json();

  // Yields {event, data} for each server-sent event of a streamed response.
  async function* events(resp) {
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf = (buf + decoder.decode(value, { stream: true })).replace(/\r\n/g, "\n");
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const raw = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        const ev = { event: "message", data: "" };
        for (const line of raw.split("\n")) {
          if (line.startsWith("data:")) ev.data += (ev.data ? "\n" : "") + line.slice(5).replace(/^ /, "");
          else if (line.startsWith("event:")) ev.event = line.slice(6).trim();
        }
        if (ev.data) yield ev;
      }
    }
  }

  return { request, getJson, events, askKey };
})();
