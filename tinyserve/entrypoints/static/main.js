// Wiring: buttons, keys, conversation list, settings, and the first calls on load.
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);

  async function send() {
    const text = $("input").value;
    if (!text.trim() || Chat.busy()) return;
    const conv = Chat.current() || Chat.newConversation();
    if (!conv.messages.length) conv.title = text.trim().slice(0, 40);
    conv.messages.push({ role: "user", content: text });
    $("input").value = "";
    Chat.showError("");
    await Chat.complete(conv);
  }

  function onMessageAction(ev) {
    const btn = ev.target.closest("button");
    if (!btn) return;
    const conv = Chat.current();
    if (btn.classList.contains("copy-code")) {
      copy(btn.parentElement.querySelector("code").textContent);
      return;
    }
    const el = btn.closest(".msg");
    if (!conv || !el || Chat.busy()) return;
    const i = Number(el.dataset.index);
    const msg = conv.messages[i];
    if (btn.dataset.act === "copy") copy(msg.content);
    else if (btn.dataset.act === "regenerate") {
      conv.messages.splice(i, 1);
      Chat.complete(conv);
    } else if (btn.dataset.act === "edit") startEdit(conv, el, i);
  }

  function startEdit(conv, el, i) {
    const content = el.querySelector(".content");
    content.innerHTML = '<textarea class="edit"></textarea><div><button type="button" data-edit="send">Save &amp; send</button> <button type="button" data-edit="cancel">Cancel</button></div>';
    const area = content.querySelector("textarea");
    area.value = conv.messages[i].content;
    area.focus();
    content.addEventListener("click", (ev) => {
      const which = ev.target.dataset && ev.target.dataset.edit;
      if (which === "cancel") Chat.render();
      if (which === "send" && area.value.trim()) {
        conv.messages[i].content = area.value;
        conv.messages.splice(i + 1);
        Chat.complete(conv);
      }
    });
  }

  function copy(text) {
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text);
      return;
    }
    const area = document.createElement("textarea");
    area.value = text;
    document.body.appendChild(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }

  function onConversationClick(ev) {
    const li = ev.target.closest("li");
    if (!li || Chat.busy()) return;
    const state = Chat.state();
    if (ev.target.dataset.act === "delete") {
      state.conversations = state.conversations.filter((c) => c.id !== li.dataset.id);
      if (state.current === li.dataset.id) state.current = state.conversations.length ? state.conversations[0].id : null;
    } else {
      state.current = li.dataset.id;
    }
    Chat.save();
    Chat.render();
  }

  function showMode() {
    const mode = $("mode").value;
    $("schema-box").hidden = mode !== "json";
    $("tools-box").hidden = mode !== "tools";
  }

  async function loadModel() {
    try {
      const models = await Api.getJson("/v1/models");
      const id = models.data && models.data[0] && models.data[0].id;
      Chat.setModel(id);
      $("model-name").textContent = id || "";
    } catch (e) {
      Chat.showError(`cannot reach the server: ${e.message}`);
    }
  }

  window.addEventListener("DOMContentLoaded", () => {
    Chat.load();
    showMode();
    Chat.render();
    $("composer").addEventListener("submit", (ev) => { ev.preventDefault(); send(); });
    $("input").addEventListener("keydown", (ev) => {
      if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) { ev.preventDefault(); send(); }
    });
    $("stop-btn").addEventListener("click", () => Chat.stop());
    $("new-chat").addEventListener("click", () => { if (!Chat.busy()) { Chat.newConversation(); Chat.render(); } });
    $("messages").addEventListener("click", onMessageAction);
    $("conversations").addEventListener("click", onConversationClick);
    $("settings").addEventListener("change", () => { showMode(); Chat.saveSettings(); });
    $("set-key").addEventListener("click", () => Api.askKey().then(() => { loadModel(); Engine.restart(); }));
    loadModel().then(() => Engine.start());
  });
})();
