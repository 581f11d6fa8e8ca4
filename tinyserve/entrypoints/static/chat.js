// The chat: conversations kept in localStorage, streamed answers over our own
// /v1/chat/completions SSE, stop (aborts the fetch, so the server aborts the request and
// frees its KV blocks), regenerate, edit and resend, per-answer timing and token counts.
"use strict";

const Chat = (() => {
  const STORE = "tinyserve.conversations";
  const SETTINGS = "tinyserve.settings";
  const $ = (id) => document.getElementById(id);
  const FIELDS = ["system-prompt", "temperature", "top-p", "max-tokens", "seed", "stop",
    "mode", "json-schema", "tools", "tool-choice"];

  let state = { conversations: [], current: null };
  let modelName = null;
  let controller = null; // the AbortController of the answer in flight
  let pendingPaint = null;

  // -- storage -------------------------------------------------------------------------------
  function load() {
    try { state = JSON.parse(localStorage.getItem(STORE)) || state; } catch (_) { /* reset */ }
    if (!Array.isArray(state.conversations)) state = { conversations: [], current: null };
    const settings = JSON.parse(localStorage.getItem(SETTINGS) || "{}");
    for (const f of FIELDS) if (settings[f] !== undefined) $(f).value = settings[f];
  }
  function save() { localStorage.setItem(STORE, JSON.stringify(state)); }
  function saveSettings() {
    const settings = {};
    for (const f of FIELDS) settings[f] = $(f).value;
    localStorage.setItem(SETTINGS, JSON.stringify(settings));
  }
  const current = () => state.conversations.find((c) => c.id === state.current);
  function newConversation() {
    const conv = { id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`,
      title: "New chat", messages: [] };
    state.conversations.unshift(conv);
    state.current = conv.id;
    save();
    return conv;
  }

  // -- the request -----------------------------------------------------------------------------
  function wireMessages(conv) {
    const msgs = [];
    const system = $("system-prompt").value.trim();
    if (system) msgs.push({ role: "system", content: system });
    for (const m of conv.messages) {
      if (m.role === "assistant" && m.tool_calls && m.tool_calls.length) {
        msgs.push({ role: "assistant", content: m.content || null, tool_calls: m.tool_calls.map((t) => (
          { id: t.id, type: "function", function: { name: t.name, arguments: t.arguments } })) });
      } else if (m.content) {
        msgs.push({ role: m.role, content: m.content });
      }
    }
    return msgs;
  }

  function requestBody(conv) {
    const body = { model: modelName || undefined, messages: wireMessages(conv), stream: true,
      stream_options: { include_usage: true } };
    const num = (id) => ($(id).value.trim() === "" ? undefined : Number($(id).value));
    body.temperature = num("temperature");
    body.top_p = num("top-p");
    body.max_tokens = num("max-tokens");
    body.seed = num("seed");
    const stop = $("stop").value.split("\n").filter((s) => s !== "");
    if (stop.length) body.stop = stop;
    const mode = $("mode").value;
    if (mode === "json") {
      body.response_format = { type: "json_schema",
        json_schema: { name: "answer", schema: parseJson("json-schema", "JSON schema"), strict: true } };
    } else if (mode === "tools") {
      body.tools = parseJson("tools", "Tools");
      body.tool_choice = $("tool-choice").value;
    }
    return body;
  }

  function parseJson(id, what) {
    try { return JSON.parse($(id).value); } catch (e) { throw new Error(`${what} is not valid JSON: ${e.message}`); }
  }

  function applyDelta(msg, choice) {
    const d = choice.delta || {};
    if (d.content) msg.content += d.content;
    for (const tc of d.tool_calls || []) {
      msg.tool_calls = msg.tool_calls || [];
      const slot = msg.tool_calls[tc.index] || (msg.tool_calls[tc.index] = { id: "", name: "", arguments: "" });
      if (tc.id) slot.id = tc.id;
      if (tc.function && tc.function.name) slot.name += tc.function.name;
      if (tc.function && tc.function.arguments) slot.arguments += tc.function.arguments;
    }
    if (choice.finish_reason) msg.finish_reason = choice.finish_reason;
    return Boolean(d.content || d.tool_calls);
  }

  async function complete(conv) {
    let body;
    try { body = requestBody(conv); } catch (e) { showError(e.message); return; }
    const msg = { role: "assistant", content: "", deltas: 0 };
    conv.messages.push(msg);
    save();
    render();
    controller = new AbortController();
    setBusy(true);
    const t0 = performance.now();
    let tFirst = null;
    try {
      const resp = await Api.request("/v1/chat/completions", { method: "POST", body, signal: controller.signal });
      for await (const ev of Api.events(resp)) {
        if (ev.data === "[DONE]") break;
        const chunk = JSON.parse(ev.data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) msg.usage = chunk.usage;
        const choice = (chunk.choices || [])[0];
        if (choice && applyDelta(msg, choice)) {
          if (tFirst === null) tFirst = performance.now();
          msg.deltas += 1;
          paintSoon(conv, msg);
        }
      }
    } catch (e) {
      if (e.name === "AbortError") msg.stopped = true;
      else { msg.error = e.message; showError(e.message); }
    } finally {
      msg.stats = { ttft_ms: tFirst === null ? null : tFirst - t0,
        gen_ms: tFirst === null ? null : performance.now() - tFirst };
      controller = null;
      setBusy(false);
      save();
      render();
    }
  }

  function stop() { if (controller) controller.abort(); }

  // -- rendering ----------------------------------------------------------------------------
  function statsLine(msg) {
    const parts = [];
    const s = msg.stats || {};
    if (s.ttft_ms != null) parts.push(`TTFT ${Math.round(s.ttft_ms)} ms`);
    const u = msg.usage;
    if (u && u.completion_tokens > 1 && s.gen_ms > 0) {
      parts.push(`${((u.completion_tokens - 1) / (s.gen_ms / 1000)).toFixed(1)} tok/s`);
    }
    if (u) {
      const cached = (u.prompt_tokens_details && u.prompt_tokens_details.cached_tokens) || 0;
      parts.push(`${u.prompt_tokens} prompt (${cached} cached) + ${u.completion_tokens} completion tokens`);
    }
    if (msg.finish_reason && msg.finish_reason !== "stop") parts.push(`finish: ${msg.finish_reason}`);
    if (msg.stopped) parts.push("stopped");
    if (msg.error) parts.push(`error: ${msg.error}`);
    return parts.join(" · ");
  }

  function contentHtml(msg) {
    let html = msg.role === "assistant" ? Markdown.render(msg.content) : `<p>${Markdown.escapeHtml(msg.content).replace(/\n/g, "<br>")}</p>`;
    for (const t of msg.tool_calls || []) {
      let args = t.arguments;
      try { args = JSON.stringify(JSON.parse(t.arguments), null, 2); } catch (_) { /* still streaming */ }
      html += `<div class="tool-call">tool call <b>${Markdown.escapeHtml(t.name)}</b>(${Markdown.escapeHtml(args)})</div>`;
    }
    return html;
  }

  function messageElement(conv, msg, i) {
    const el = document.createElement("div");
    el.className = `msg ${msg.role}`;
    el.dataset.index = i;
    el.dataset.deltas = msg.deltas || 0;
    const last = i === conv.messages.length - 1;
    const actions = msg.role === "user" ? '<button data-act="edit" type="button">edit</button>'
      : `<button data-act="copy" type="button">copy</button>${last ? '<button data-act="regenerate" type="button">regenerate</button>' : ""}`;
    el.innerHTML = `<div class="role">${msg.role}<span class="actions">${actions}</span></div>
      <div class="content">${contentHtml(msg)}</div><div class="stats">${Markdown.escapeHtml(statsLine(msg))}</div>`;
    return el;
  }

  function render() {
    const conv = current();
    const list = $("conversations");
    list.innerHTML = "";
    for (const c of state.conversations) {
      const li = document.createElement("li");
      li.dataset.id = c.id;
      li.className = c.id === state.current ? "active" : "";
      li.innerHTML = `<span>${Markdown.escapeHtml(c.title)}</span><button data-act="delete" title="delete" type="button">×</button>`;
      list.appendChild(li);
    }
    const box = $("messages");
    box.innerHTML = "";
    if (!conv) return;
    conv.messages.forEach((m, i) => box.appendChild(messageElement(conv, m, i)));
    box.scrollTop = box.scrollHeight;
  }

  function paintSoon(conv, msg) {
    if (pendingPaint) return;
    pendingPaint = requestAnimationFrame(() => {
      pendingPaint = null;
      const i = conv.messages.indexOf(msg);
      const el = document.querySelector(`#messages .msg[data-index="${i}"]`);
      if (!el || conv !== current()) return;
      el.querySelector(".content").innerHTML = contentHtml(msg);
      el.dataset.deltas = msg.deltas;
      const box = $("messages");
      box.scrollTop = box.scrollHeight;
    });
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop-btn").hidden = !busy;
    document.body.dataset.busy = busy ? "1" : "";
  }

  function showError(text) {
    const el = $("error");
    el.textContent = text;
    el.hidden = !text;
  }

  return { load, save, saveSettings, current, newConversation, complete, stop, render,
    showError, setModel: (m) => { modelName = m; }, busy: () => controller !== null,
    state: () => state };
})();
