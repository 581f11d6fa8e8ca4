// The engine view: snapshots from /v1/engine/events (server-sent events), drawn as the
// batch of each step (decode rows and prefill tokens), the KV block pool and the requests
// that own the blocks. The server samples the engine only while someone is connected, so
// unticking "live" closes the stream.
"use strict";

const Engine = (() => {
  const $ = (id) => document.getElementById(id);
  const HISTORY = 120; // steps kept for the chart
  const COLORS = { ".": "--free", c: "--cached", u: "--used", s: "--shared" };
  let steps = [];
  let last = null;
  let controller = null;
  let retryMs = 500;

  const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  const short = (id) => (id.length > 12 ? `…${id.slice(-8)}` : id);

  function status(text) { $("engine-status").textContent = text; }

  async function connect() {
    controller = new AbortController();
    const mine = controller;
    try {
      const resp = await Api.request("/v1/engine/events?interval_ms=250", { signal: mine.signal });
      status("live");
      retryMs = 500;
      for await (const ev of Api.events(resp)) {
        if (ev.event === "snapshot") update(JSON.parse(ev.data));
      }
      status("stream ended; reconnecting…");
    } catch (e) {
      if (e.name === "AbortError") return;
      status(e.status === 404 ? "this server has no engine view" : `disconnected (${e.message}); retrying…`);
      if (e.status === 404) return;
    }
    if (controller === mine) {
      setTimeout(() => { if (controller === mine) connect(); }, retryMs);
      retryMs = Math.min(retryMs * 2, 5000);
    }
  }

  function start() { if ($("engine-live").checked && !controller) connect(); }
  function stop() { if (controller) { const c = controller; controller = null; c.abort(); } status("paused"); }
  function restart() { stop(); start(); }

  function update(snap) {
    last = snap;
    for (const s of snap.steps || []) steps.push(s);
    if (steps.length > HISTORY) steps = steps.slice(-HISTORY);
    const view = $("engine");
    view.dataset.step = snap.step;
    view.dataset.running = snap.running;
    view.dataset.waiting = snap.waiting;
    view.dataset.kvUsage = snap.kv.usage;
    $("eng-running").textContent = snap.running;
    $("eng-waiting").textContent = snap.waiting;
    $("eng-step").textContent = snap.step;
    const lastStep = steps[steps.length - 1];
    $("eng-step-ms").textContent = lastStep ? `${lastStep.ms.toFixed(1)} ms` : "–";
    $("eng-kv").textContent = `${(100 * snap.kv.usage).toFixed(1)}% (${snap.kv.used}/${snap.kv.total})`;
    const pc = snap.prefix_cache;
    $("eng-prefix").textContent = pc.queries ? `${(100 * pc.hit_rate).toFixed(0)}%` : "–";
    $("last-step").textContent = lastStep ? describe(lastStep) : "idle";
    drawChart();
    drawPool(snap);
    fillTable(snap);
  }

  function describe(s) {
    const parts = [`step ${s.step}: ${s.decode} decode rows`];
    if (s.prefill_tokens) parts.push(`${s.prefill_tokens} prefill tokens (${s.prefill.map((p) => `${short(p.id)}: ${p.tokens}`).join(", ")})`);
    if (s.spec_tokens) parts.push(`${s.spec_tokens} draft tokens`);
    if (s.preempted && s.preempted.length) parts.push(`preempted ${s.preempted.map(short).join(", ")}`);
    return `${parts.join(" + ")}, ${s.ms.toFixed(1)} ms`;
  }

  // One bar per step: decode rows stacked under prefill tokens (square-root scale, so a
  // 512-token prefill chunk and 3 decode rows are both visible); a red cap marks preemption.
  function drawChart() {
    const canvas = $("batch-chart");
    const ctx = canvas.getContext("2d");
    const { width, height } = canvas;
    ctx.clearRect(0, 0, width, height);
    const top = Math.max(4, ...steps.map((s) => s.decode + s.prefill_tokens));
    const scale = (n) => (height - 8) * Math.sqrt(n / top);
    const w = width / HISTORY;
    steps.forEach((s, i) => {
      const x = i * w;
      const hd = scale(s.decode);
      const ht = scale(s.decode + s.prefill_tokens);
      ctx.fillStyle = css("--decode");
      ctx.fillRect(x, height - hd, Math.max(1, w - 1), hd);
      ctx.fillStyle = css("--prefill");
      ctx.fillRect(x, height - ht, Math.max(1, w - 1), ht - hd);
      if (s.preempted && s.preempted.length) {
        ctx.fillStyle = css("--preempt");
        ctx.fillRect(x, 0, Math.max(1, w - 1), 5);
      }
    });
  }

  function poolGeometry(total, canvas) {
    const cols = Math.max(1, Math.ceil(Math.sqrt(total * canvas.width / canvas.height)));
    const cell = canvas.width / cols;
    return { cols, cell, rows: Math.ceil(total / cols) };
  }

  function drawPool(snap) {
    const canvas = $("kv-pool");
    const pool = snap.pool || "";
    const g = poolGeometry(pool.length, canvas);
    canvas.height = Math.max(20, Math.ceil(g.rows * g.cell));
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    const colors = {};
    for (const [k, v] of Object.entries(COLORS)) colors[k] = css(v);
    const gap = g.cell > 4 ? 1 : 0;
    for (let i = 0; i < pool.length; i++) {
      ctx.fillStyle = colors[pool[i]] || "#000";
      ctx.fillRect((i % g.cols) * g.cell, Math.floor(i / g.cols) * g.cell, g.cell - gap, g.cell - gap);
    }
    canvas.dataset.used = snap.kv.used;
  }

  function onPoolHover(ev) {
    if (!last || !last.pool) return;
    const canvas = $("kv-pool");
    const rect = canvas.getBoundingClientRect();
    const g = poolGeometry(last.pool.length, canvas);
    const x = (ev.clientX - rect.left) * (canvas.width / rect.width);
    const y = (ev.clientY - rect.top) * (canvas.height / rect.height);
    const block = Math.floor(y / g.cell) * g.cols + Math.floor(x / g.cell);
    if (block < 0 || block >= last.pool.length) return;
    const owners = (last.requests || []).filter((r) => r.blocks.includes(block)).map((r) => short(r.id));
    const kind = { ".": "free", c: "free, holds a cached prefix", u: "used", s: "shared" }[last.pool[block]];
    $("pool-hover").textContent = `block ${block}: ${kind}${owners.length ? ` — ${owners.join(", ")}` : ""}`;
  }

  function fillTable(snap) {
    const body = $("engine-requests").querySelector("tbody");
    body.innerHTML = "";
    for (const r of snap.requests || []) {
      const tr = document.createElement("tr");
      tr.dataset.state = r.state;
      const cells = [short(r.id), r.state, r.prompt_tokens, r.computed_tokens, r.output_tokens, r.cached_tokens, r.blocks.length];
      tr.innerHTML = cells.map((c) => `<td>${Markdown.escapeHtml(String(c))}</td>`).join("");
      tr.title = r.id;
      body.appendChild(tr);
    }
  }

  window.addEventListener("DOMContentLoaded", () => {
    $("engine-live").addEventListener("change", (ev) => (ev.target.checked ? start() : stop()));
    $("kv-pool").addEventListener("mousemove", onPoolHover);
  });
  // Nobody looks at a hidden tab or a page being left: close the stream, so the server
  // stops sampling the engine (a page kept in the back/forward cache would hold it open).
  window.addEventListener("pagehide", () => stop());
  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "hidden") stop();
    else start();
  });

  return { start, stop, restart };
})();
