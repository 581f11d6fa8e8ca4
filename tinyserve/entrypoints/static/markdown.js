// A small, safe markdown renderer for model answers: fenced code blocks, inline code, bold,
// italics, headings, lists, links (http/https only) and paragraphs. Everything is
// HTML-escaped first, so model output can never inject markup or scripts.
"use strict";

const Markdown = (() => {
  const escapeHtml = (s) =>
    s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;")
      .replace(/"/g, "&quot;").replace(/'/g, "&#39;");

  function inline(text) {
    // Split out inline code first so its contents are not formatted.
    return text.split(/(`[^`\n]+`)/g).map((part) => {
      if (part.length > 1 && part.startsWith("`") && part.endsWith("`")) {
        return `<code>${escapeHtml(part.slice(1, -1))}</code>`;
      }
      let s = escapeHtml(part);
      s = s.replace(/\*\*([^*\n]+)\*\*/g, "<strong>$1</strong>");
      s = s.replace(/(^|[^*])\*([^*\n]+)\*/g, "$1<em>$2</em>");
      s = s.replace(/\[([^\]\n]+)\]\((https?:\/\/[^)\s]+)\)/g,
        '<a href="$2" target="_blank" rel="noopener noreferrer">$1</a>');
      return s;
    }).join("");
  }

  function blocks(text) {
    const out = [];
    let para = [];
    let list = null; // {tag, items}
    const flushPara = () => {
      if (para.length) out.push(`<p>${para.map(inline).join("<br>")}</p>`);
      para = [];
    };
    const flushList = () => {
      if (list) out.push(`<${list.tag}>${list.items.map((i) => `<li>${inline(i)}</li>`).join("")}</${list.tag}>`);
      list = null;
    };
    for (const line of text.split("\n")) {
      const heading = /^(#{1,6})\s+(.*)$/.exec(line);
      const bullet = /^\s*[-*+]\s+(.*)$/.exec(line);
      const numbered = /^\s*\d+[.)]\s+(.*)$/.exec(line);
      if (heading) {
        flushPara(); flushList();
        const level = Math.min(heading[1].length + 2, 6);
        out.push(`<h${level}>${inline(heading[2])}</h${level}>`);
      } else if (bullet || numbered) {
        flushPara();
        const tag = bullet ? "ul" : "ol";
        if (!list || list.tag !== tag) { flushList(); list = { tag, items: [] }; }
        list.items.push((bullet || numbered)[1]);
      } else if (line.trim() === "") {
        flushPara(); flushList();
      } else {
        flushList();
        para.push(line);
      }
    }
    flushPara(); flushList();
    return out.join("");
  }

  // Returns HTML. An unterminated fence (an answer still streaming) renders as code so far.
  function render(text) {
    const parts = text.split(/^```/m);
    let html = "";
    parts.forEach((part, i) => {
      if (i % 2 === 0) {
        html += blocks(part);
      } else {
        const nl = part.indexOf("\n");
        const lang = nl >= 0 ? part.slice(0, nl).trim() : "";
        const code = nl >= 0 ? part.slice(nl + 1) : "";
        const cls = /^[\w+-]+$/.test(lang) ? ` class="language-${lang}"` : "";
        html += `<pre><button class="copy-code" type="button">copy</button><code${cls}>${escapeHtml(code.replace(/\n$/, ""))}</code></pre>`;
      }
    });
    return html;
  }

  return { render, escapeHtml };
})();
