// The chat page's script (static/index.html loads it after the vendored marked, DOMPurify and highlight.js).
//
// Safety: everything the model writes enters the DOM either as textContent (reasoning, tool calls) or through
// renderMarkdown(): marked turns markdown into HTML with any raw HTML in it escaped to text, DOMPurify sanitizes
// that HTML, and highlight.js colours code from its text. Requests go to this page's own origin only (api()).
// Conversations live in this browser's localStorage ("mtpserve.chat.<id>"), never on the server.
"use strict";
(() => {
  // The page is served at "<prefix>/" or "<prefix>/index.html": the API lives next to it.
  const BASE = location.pathname.replace(/[^/]*$/, "");
  const $ = (id) => document.getElementById(id);
  const el = {
    model: $("model-name"), context: $("context"), key: $("api-key"), newChat: $("new-chat"),
    temperature: $("temperature"), maxTokens: $("max-tokens"), thinking: $("thinking"),
    thinkingLabel: $("thinking-label"), error: $("error"), messages: $("messages"), empty: $("empty"),
    scroller: $("scroller"), prompt: $("prompt"), send: $("send"), stop: $("stop"),
    conversations: $("conversations"), exportAll: $("export-all"), toggleSidebar: $("toggle-sidebar"),
  };

  // --- storage: settings and conversations ---------------------------------------------------------------
  const PREFIX = "mtpserve.";
  const CHAT_PREFIX = PREFIX + "chat.";
  const store = {
    get(k) { try { return localStorage.getItem(PREFIX + k); } catch (_) { return null; } },
    set(k, v) { try { localStorage.setItem(PREFIX + k, v); } catch (_) { /* private mode */ } },
  };

  // A conversation: {id, title, renamed, created, updated, messages: [message]}; a message: {role: "user",
  // content} or {role: "assistant", content, reasoning, tool_calls: [{name, arguments}], timings, usage,
  // stopped, error}.
  const chats = {
    list() {
      const out = [];
      try {
        for (let i = 0; i < localStorage.length; i++) {
          const k = localStorage.key(i);
          if (!k || !k.startsWith(CHAT_PREFIX)) continue;
          const c = chats.load(k.slice(CHAT_PREFIX.length));
          if (c) out.push(c);
        }
      } catch (_) { /* storage unavailable */ }
      return out.sort((a, b) => b.updated - a.updated);
    },
    load(id) {
      try {
        const c = JSON.parse(localStorage.getItem(CHAT_PREFIX + id));
        return c && Array.isArray(c.messages) ? c : null;
      } catch (_) { return null; }
    },
    save(c) {
      try { localStorage.setItem(CHAT_PREFIX + c.id, JSON.stringify(c)); } catch (e) {
        showError("This conversation could not be saved in the browser: " + e.message + " (delete old ones)");
      }
    },
    remove(id) { try { localStorage.removeItem(CHAT_PREFIX + id); } catch (_) { /* storage unavailable */ } },
  };

  let conv = null;     // the conversation on screen (null: a new one, saved at its first message)
  let running = null;  // {controller, target} of the reply being streamed
  let nCtx = null;     // a slot's context size, from /v1/models
  let thinkingSupported = false;

  // --- settings ------------------------------------------------------------------------------------------
  el.key.value = store.get("apiKey") || "";
  for (const [input, name] of [[el.temperature, "temperature"], [el.maxTokens, "maxTokens"]]) {
    const saved = store.get(name);
    if (saved !== null && saved !== "") input.value = saved;
    input.addEventListener("change", () => store.set(name, input.value));
  }
  el.thinking.checked = store.get("thinking") !== "0";
  el.thinking.addEventListener("change", () => store.set("thinking", el.thinking.checked ? "1" : "0"));
  el.key.addEventListener("input", () => {
    store.set("apiKey", el.key.value.trim());
    el.key.classList.remove("needed");
  });
  el.key.addEventListener("change", () => loadServerInfo());

  // Every request: to this page's own server (relative to the page, so --api-prefix works), with the key.
  function api(path, init = {}) {
    const url = new URL(BASE + path, location.href);
    if (url.origin !== location.origin) throw new Error("refusing to send a request off this server: " + url.origin);
    const headers = { "Content-Type": "application/json" };
    const key = el.key.value.trim();
    if (key) headers["Authorization"] = "Bearer " + key;
    return fetch(url.href, { ...init, headers });
  }

  // --- errors --------------------------------------------------------------------------------------------
  function showError(text) { el.error.textContent = text; el.error.hidden = false; }
  function clearError() { el.error.textContent = ""; el.error.hidden = true; }

  async function httpError(resp) {
    let message = "";
    try {
      const body = await resp.json();
      message = (body && body.error && body.error.message) || "";
    } catch (_) { /* not JSON */ }
    message = message || resp.statusText || "request failed";
    if (resp.status === 401) {
      el.key.classList.add("needed");
      el.key.focus();
      return `${message} (HTTP 401): this server needs an API key. Enter it in the "API key" field at the top, then send again.`;
    }
    return `${message} (HTTP ${resp.status})`;
  }

  // --- what the server knows: model, context size, thinking ----------------------------------------------
  async function loadServerInfo(attempt = 0) {
    try {
      const resp = await api("v1/models");
      if (resp.status === 503 && attempt < 120) { // still loading the model
        el.model.textContent = "loading…";
        setTimeout(() => loadServerInfo(attempt + 1), 1000);
        return;
      }
      if (!resp.ok) { el.model.textContent = "?"; showError(await httpError(resp)); return; }
      const body = await resp.json();
      const entry = body && body.data && body.data[0];
      const id = entry && entry.id;
      el.model.textContent = id || "?";
      el.model.title = id || "";
      if (id) document.title = id + " · mtpserve";
      nCtx = (entry && entry.meta && entry.meta.n_ctx) || null;
      showContext();
    } catch (e) {
      el.model.textContent = "?";
      showError("Cannot reach the server: " + e.message);
      return;
    }
    // /props needs the key on a keyed server: without it the switch stays hidden until the key is entered.
    try {
      const resp = await api("props");
      if (!resp.ok) return;
      const props = await resp.json();
      // The server's own rule for a thinking template (chat/template.py: supports_thinking).
      thinkingSupported = typeof props.chat_template === "string" && props.chat_template.includes("<think>");
      el.thinkingLabel.hidden = !thinkingSupported;
    } catch (_) { /* the model name is enough */ }
  }

  function contextUsed(c) {
    const last = c && [...c.messages].reverse().find((m) => m.role === "assistant" && (m.timings || m.usage));
    if (!last) return 0;
    const t = last.timings;
    if (t && typeof t.prompt_n === "number") return (t.cache_n || 0) + t.prompt_n + (t.predicted_n || 0);
    return (last.usage && last.usage.total_tokens) || 0;
  }

  function showContext() {
    el.context.textContent = nCtx ? `context: ${contextUsed(conv)} / ${nCtx} tokens` : "";
  }

  // --- markdown ------------------------------------------------------------------------------------------
  const libsLoaded = typeof marked === "object" && typeof DOMPurify === "function" && typeof hljs === "object";

  function escapeHtml(s) {
    return String(s).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  }

  // LaTeX stays text (no math library is vendored), but kept away from markdown, which would eat its
  // backslashes and underscores: $$…$$ and \[…\] on their own lines, $…$ and \(…\) inline ("$5 and $6" is not).
  const mathExtension = {
    extensions: [
      {
        name: "mathBlock", level: "block",
        start(src) { const m = /^(?:\$\$|\\\[)/m.exec(src); return m ? m.index : undefined; },
        tokenizer(src) {
          const m = /^(?:\$\$[\s\S]+?\$\$|\\\[[\s\S]+?\\\])[ \t]*(?:\n|$)/.exec(src);
          if (m) return { type: "mathBlock", raw: m[0], text: m[0].trim() };
        },
        renderer(token) { return `<div class="math">${escapeHtml(token.text)}</div>\n`; },
      },
      {
        name: "mathInline", level: "inline",
        start(src) { const m = /\$|\\\(/.exec(src); return m ? m.index : undefined; },
        tokenizer(src) {
          const m = /^(?:\$\$[^\n]+?\$\$|\\\([^\n]+?\\\)|\$(?=\S)[^$\n]*?\S\$(?!\d))/.exec(src);
          if (m) return { type: "mathInline", raw: m[0], text: m[0] };
        },
        renderer(token) { return `<span class="math">${escapeHtml(token.text)}</span>`; },
      },
    ],
  };

  const md = libsLoaded ? new marked.Marked() : null;
  if (md) {
    md.use({
      gfm: true,
      breaks: false,
      // HTML written by the model is shown as the text it is, never as markup.
      renderer: { html: (token) => (token.block ? `<p>${escapeHtml(token.text)}</p>\n` : escapeHtml(token.text)) },
    }, mathExtension);
    // A link the model writes opens in a new tab and tells the target nothing about this page.
    DOMPurify.addHook("afterSanitizeAttributes", (node) => {
      if (node.tagName === "A" && node.hasAttribute("href")) {
        node.setAttribute("target", "_blank");
        node.setAttribute("rel", "noopener noreferrer nofollow");
      }
    });
  }
  const PURIFY = {
    USE_PROFILES: { html: true }, // no SVG or MathML
    FORBID_TAGS: ["style", "form"],
    FORBID_ATTR: ["style"], // the CSP forbids inline styles anyway
    SANITIZE_NAMED_PROPS: true, // an id or name from the model is prefixed: it cannot shadow the page's own
    RETURN_DOM_FRAGMENT: true,
  };

  // Markdown -> a sanitized DocumentFragment, code highlighted and given a copy button. `final`: the whole
  // text has arrived (code without a language is auto-detected only then: it tries every language).
  function renderMarkdown(text, final = true) {
    if (!libsLoaded) { // a vendored file failed to load: plain text, still safe
      const p = document.createElement("p");
      p.className = "plain";
      p.textContent = text;
      const frag = document.createDocumentFragment();
      frag.append(p);
      return frag;
    }
    const frag = DOMPurify.sanitize(md.parse(text, { async: false }), PURIFY);
    for (const code of frag.querySelectorAll("pre > code")) {
      const m = /\blanguage-([\w+#.-]+)/.exec(code.className);
      const lang = m ? m[1] : "";
      if (lang && !hljs.getLanguage(lang)) { code.className = "language-plaintext"; }
      // Without a language, highlight.js guesses one for the colours; the label names only a declared one.
      if (lang || final) hljs.highlightElement(code);
      const pre = code.parentNode;
      const block = div("code-block");
      const head = div("code-head");
      const label = document.createElement("span");
      label.className = "code-lang";
      label.textContent = lang;
      head.append(label, button("Copy", "copy-code", "Copy the code"));
      pre.replaceWith(block);
      block.append(head, pre);
    }
    return frag;
  }

  function copyText(text, btn) {
    const done = (ok) => {
      btn.textContent = ok ? "Copied" : "Copy failed";
      setTimeout(() => { btn.textContent = "Copy"; }, 1500);
    };
    const fallback = () => { // http:// on another host is not a secure context: no navigator.clipboard
      const t = document.createElement("textarea");
      t.value = text;
      t.className = "offscreen";
      document.body.append(t);
      t.select();
      let ok = false;
      try { ok = document.execCommand("copy"); } catch (_) { ok = false; }
      t.remove();
      done(ok);
    };
    if (navigator.clipboard && window.isSecureContext) navigator.clipboard.writeText(text).then(() => done(true), fallback);
    else fallback();
  }

  // --- building the transcript -------------------------------------------------------------------------
  function div(cls, text) {
    const d = document.createElement("div");
    d.className = cls;
    if (text !== undefined) d.textContent = text;
    return d;
  }

  function button(text, cls, title) {
    const b = document.createElement("button");
    b.type = "button";
    b.className = cls;
    b.textContent = text;
    if (title) b.title = title;
    return b;
  }

  function nearBottom() { return el.scroller.scrollHeight - el.scroller.scrollTop - el.scroller.clientHeight < 80; }
  function scrollDown(force) { if (force || nearBottom()) el.scroller.scrollTop = el.scroller.scrollHeight; }

  function clearTranscript() {
    for (const m of Array.from(el.messages.querySelectorAll(".msg"))) m.remove();
    el.empty.hidden = false;
  }

  function head(role, actions) {
    const h = div("head");
    const box = div("actions");
    box.append(...actions);
    h.append(div("role", role), box);
    return h;
  }

  // A user turn: text as typed, with Edit (then regenerate from it) and Copy.
  function userNode(msg, index) {
    const m = div("msg user");
    m.dataset.index = index;
    const edit = button("Edit", "icon edit needs-idle", "Edit this message and regenerate the reply");
    const copy = button("Copy", "icon copy", "Copy this message");
    const content = div("content", msg.content);
    m.append(head("You", [edit, copy]), content);
    copy.addEventListener("click", () => copyText(msg.content, copy));
    edit.addEventListener("click", () => startEdit(m, index, msg.content));
    return m;
  }

  function startEdit(node, index, text) {
    if (running || node.querySelector(".edit-box")) return;
    const content = node.querySelector(".content");
    const box = document.createElement("textarea");
    box.className = "edit-box";
    box.value = text;
    const send = button("Send", "primary edit-send", "Replace this message and regenerate everything after it");
    const cancel = button("Cancel", "edit-cancel");
    const row = div("edit-buttons");
    row.append(cancel, send);
    content.hidden = true;
    node.append(box, row);
    box.focus();
    const close = () => { box.remove(); row.remove(); content.hidden = false; };
    cancel.addEventListener("click", close);
    send.addEventListener("click", () => { if (box.value.trim()) editAndRegenerate(index, box.value); });
    box.addEventListener("keydown", (e) => {
      if (e.key === "Escape") close();
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        send.click();
      }
    });
  }

  // An assistant turn; `index` is its place in the conversation (null while streaming or for mtpRender).
  class AssistantView {
    constructor(msg, index) {
      this.msg = msg;
      this.node = div("msg assistant");
      if (index !== null) this.node.dataset.index = index;
      const copy = button("Copy", "icon copy", "Copy this reply as markdown");
      copy.addEventListener("click", () => copyText(this.msg.content, copy));
      const actions = [copy];
      if (index !== null) {
        const regen = button("Regenerate", "icon regenerate needs-idle", "Drop this reply and generate it again");
        regen.addEventListener("click", () => regenerate(index));
        actions.unshift(regen);
      }
      this.content = div("content");
      this.node.append(head("Assistant", actions), this.content);
      this.details = null;
      this.tools = null;
      this.timer = null;
      this.painted = "";
    }

    reasoningBlock() {
      if (!this.details) {
        this.details = document.createElement("details");
        this.details.className = "reasoning";
        this.summary = document.createElement("summary");
        this.reasoning = div("reasoning-text");
        this.details.append(this.summary, this.reasoning);
        this.node.insertBefore(this.details, this.content);
      }
      return this.details;
    }

    // While streaming: reasoning open ("Thinking…") until the answer starts; repainted at most every 50 ms.
    update() {
      const msg = this.msg;
      if (msg.reasoning) {
        const d = this.reasoningBlock();
        this.reasoning.textContent = msg.reasoning;
        const thinking = !msg.content;
        if (this.thinking !== thinking) {
          this.thinking = thinking;
          d.open = thinking;
          this.summary.textContent = thinking ? "Thinking…" : "Reasoning";
        }
      }
      if (msg.content !== this.painted && this.timer === null) {
        this.timer = setTimeout(() => {
          this.timer = null;
          this.paintContent(false);
          scrollDown(false);
        }, 50);
      }
      if (msg.tool_calls && msg.tool_calls.length) this.paintTools();
    }

    paintContent(final) {
      this.painted = this.msg.content;
      this.content.replaceChildren(renderMarkdown(this.msg.content, final));
    }

    paintTools() {
      if (!this.tools) {
        this.tools = div("tool-calls");
        this.node.insertBefore(this.tools, this.content.nextSibling);
      }
      this.tools.replaceChildren(...this.msg.tool_calls.map((call) => {
        const box = div("tool-call");
        const name = document.createElement("span");
        name.className = "name";
        name.textContent = call.name;
        const args = document.createElement("span");
        args.className = "arguments";
        args.textContent = call.arguments;
        box.append("tool call: ", name, "(", args, ")");
        return box;
      }));
    }

    // The whole reply: final markdown, reasoning folded, notes and the speed line.
    finish() {
      const msg = this.msg;
      if (this.timer !== null) { clearTimeout(this.timer); this.timer = null; }
      this.node.classList.remove("streaming");
      if (msg.reasoning) {
        this.reasoningBlock();
        this.reasoning.textContent = msg.reasoning;
        this.details.open = false;
        this.summary.textContent = "Reasoning";
      }
      this.paintContent(true);
      if (msg.tool_calls && msg.tool_calls.length) this.paintTools();
      for (const n of this.node.querySelectorAll(".note, .timings")) n.remove();
      if (msg.error) this.node.append(div("note", "error: " + msg.error));
      if (msg.stopped) this.node.append(div("note", "stopped"));
      if (msg.timings) this.node.append(div("timings", timingsText(msg.timings)));
    }
  }

  function fmt(x, digits = 1) { return typeof x === "number" && isFinite(x) ? x.toFixed(digits) : "?"; }

  function timingsText(t) {
    const parts = [
      `prompt: ${t.prompt_n} tokens, ${fmt(t.prompt_per_second)} tok/s`,
      `generated: ${t.predicted_n} tokens, ${fmt(t.predicted_per_second)} tok/s`,
    ];
    if (typeof t.draft_n === "number") {
      const pct = t.draft_n > 0 ? (100 * t.draft_n_accepted) / t.draft_n : 0;
      parts.push(`draft accepted: ${t.draft_n_accepted}/${t.draft_n} (${fmt(pct)}%)`);
    }
    return parts.join(" · ");
  }

  function showConversation() {
    clearTranscript();
    if (conv) {
      conv.messages.forEach((msg, i) => {
        if (msg.role === "user") el.messages.append(userNode(msg, i));
        else {
          const view = new AssistantView(msg, i);
          view.finish();
          el.messages.append(view.node);
        }
      });
      el.empty.hidden = conv.messages.length > 0;
    }
    showContext();
    showSidebar();
    scrollDown(true);
  }

  // --- the side panel ------------------------------------------------------------------------------------
  function showSidebar() {
    const items = chats.list().map((c) => {
      const li = document.createElement("li");
      li.className = "conversation" + (conv && conv.id === c.id ? " current" : "");
      li.dataset.id = c.id;
      const open = button(c.title || "(untitled)", "open", c.title);
      const rename = button("✎", "icon rename", "Rename");
      const save = button("⤓", "icon export", "Export as JSON");
      const del = button("✕", "icon delete", "Delete");
      li.append(open, rename, save, del);
      open.addEventListener("click", () => openConversation(c.id));
      rename.addEventListener("click", () => startRename(li, c.id));
      save.addEventListener("click", () => { const full = chats.load(c.id); if (full) download(full.title, full); });
      del.addEventListener("click", () => deleteConversation(c.id));
      return li;
    });
    el.conversations.replaceChildren(...items);
  }

  function stopRunning() {
    if (running) running.controller.abort();
  }

  function openConversation(id) {
    const c = chats.load(id);
    if (!c) { showSidebar(); return; }
    if (conv && conv.id === id) return;
    stopRunning();
    clearError();
    conv = c;
    store.set("current", id);
    document.body.classList.remove("sidebar-open");
    showConversation();
  }

  function startRename(li, id) {
    const c = chats.load(id);
    if (!c || li.querySelector(".rename-box")) return;
    const open = li.querySelector(".open");
    const box = document.createElement("input");
    box.className = "rename-box";
    box.value = c.title;
    open.hidden = true;
    li.insertBefore(box, open);
    box.focus();
    box.select();
    let finished = false;
    const finish = (keep) => {
      if (finished) return;
      finished = true;
      const title = box.value.trim();
      if (keep && title) {
        const fresh = chats.load(id) || c;
        fresh.title = title;
        fresh.renamed = true;
        chats.save(fresh);
        if (conv && conv.id === id) { conv.title = title; conv.renamed = true; }
      }
      showSidebar();
    };
    box.addEventListener("keydown", (e) => {
      if (e.key === "Enter") finish(true);
      if (e.key === "Escape") finish(false);
    });
    box.addEventListener("blur", () => finish(true));
  }

  function deleteConversation(id) {
    const c = chats.load(id);
    if (!c || !confirm(`Delete the conversation "${c.title}"?`)) return;
    chats.remove(id);
    if (conv && conv.id === id) newChat();
    else showSidebar();
  }

  function download(title, data) {
    const exported = { exported_by: "mtpserve", version: 1, exported_at: new Date().toISOString() };
    const body = Array.isArray(data) ? { ...exported, conversations: data } : { ...exported, conversation: data };
    const blob = new Blob([JSON.stringify(body, null, 2)], { type: "application/json" });
    const a = document.createElement("a");
    a.href = URL.createObjectURL(blob);
    a.download = (title || "conversation").replace(/[^\w.-]+/g, "_").slice(0, 60) + ".json";
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 10000);
  }

  function newChat() {
    stopRunning();
    conv = null;
    store.set("current", "");
    clearTranscript();
    clearError();
    showContext();
    showSidebar();
    el.prompt.focus();
  }

  // --- sending -------------------------------------------------------------------------------------------
  function setBusy(busy) {
    el.send.disabled = busy;
    el.stop.disabled = !busy;
    document.body.classList.toggle("busy", busy);
  }

  function requestBody(messages) {
    const body = {
      messages: messages.map((m) => ({ role: m.role, content: m.content })),
      stream: true,
      stream_options: { include_usage: true },
    };
    const temperature = parseFloat(el.temperature.value);
    if (isFinite(temperature)) body.temperature = temperature;
    const maxTokens = parseInt(el.maxTokens.value, 10);
    if (isFinite(maxTokens)) body.max_tokens = maxTokens;
    if (thinkingSupported && !el.thinking.checked) body.chat_template_kwargs = { enable_thinking: false };
    return body;
  }

  function titleFrom(text) {
    const line = text.trim().split("\n")[0];
    return line.length > 60 ? line.slice(0, 59) + "…" : line;
  }

  function touch(c) {
    c.updated = Date.now();
    const first = c.messages.find((m) => m.role === "user");
    if (!c.renamed && first) c.title = titleFrom(first.content);
    chats.save(c);
  }

  // Streams a reply to `target`'s messages (ending with a user turn) and appends it there. Returns
  // {failed, produced}: a failure with nothing produced appends nothing.
  async function generate(target) {
    const msg = { role: "assistant", content: "", reasoning: "", tool_calls: [] };
    const view = new AssistantView(msg, null);
    view.node.classList.add("streaming");
    el.empty.hidden = true;
    el.messages.append(view.node);
    scrollDown(true);
    const controller = new AbortController();
    running = { controller, target };
    setBusy(true);

    let failed = null; // error message, if the request failed
    let timings = null;
    let usage = null;
    try {
      const resp = await api("v1/chat/completions", {
        method: "POST", body: JSON.stringify(requestBody(target.messages)), signal: controller.signal,
      });
      if (!resp.ok) throw new Error(await httpError(resp));
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buffer = "";
      let done = false;
      const onData = (payload) => {
        if (payload === "[DONE]") { done = true; return; }
        let chunk;
        try { chunk = JSON.parse(payload); } catch (_) { return; }
        if (chunk.error) {
          failed = (chunk.error.message || JSON.stringify(chunk.error));
          done = true;
          return;
        }
        if (chunk.timings) timings = chunk.timings;
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices && chunk.choices[0];
        const delta = choice && choice.delta;
        if (!delta) return;
        if (delta.reasoning_content) msg.reasoning += delta.reasoning_content;
        if (delta.content) msg.content += delta.content;
        if (Array.isArray(delta.tool_calls)) {
          for (const d of delta.tool_calls) {
            const i = typeof d.index === "number" ? d.index : msg.tool_calls.length;
            const call = msg.tool_calls[i] || (msg.tool_calls[i] = { name: "", arguments: "" });
            const fn = d.function || {};
            if (fn.name) call.name += fn.name;
            if (fn.arguments) call.arguments += fn.arguments;
          }
        }
        view.update();
        scrollDown(false);
      };
      while (!done) {
        const { value, done: eof } = await reader.read();
        if (eof) break;
        buffer += decoder.decode(value, { stream: true });
        let nl;
        while (!done && (nl = buffer.indexOf("\n")) >= 0) {
          const line = buffer.slice(0, nl).replace(/\r$/, "");
          buffer = buffer.slice(nl + 1);
          if (!line || line.startsWith(":")) continue; // blank separator or keep-alive comment
          if (line.startsWith("data:")) onData(line.slice(5).trim());
        }
      }
      if (done) reader.cancel().catch(() => {});
    } catch (e) {
      if (e.name === "AbortError") msg.stopped = true;
      else failed = e.message || String(e);
    }
    running = null;
    setBusy(false);
    clearTimeout(view.timer); // a repaint still pending: the finished reply replaces this view

    if (!msg.reasoning) delete msg.reasoning;
    if (!msg.tool_calls.length) delete msg.tool_calls;
    const produced = msg.content !== "" || "reasoning" in msg || "tool_calls" in msg;
    if (failed !== null && !produced) {
      view.node.remove();
      return { failed, produced };
    }
    if (failed !== null) msg.error = failed;
    if (timings) msg.timings = timings;
    if (usage) msg.usage = usage;
    target.messages.push(msg);
    touch(target);
    if (target === conv) {
      // The finished reply as a stored one is shown (with its place, for Regenerate).
      const done = new AssistantView(msg, target.messages.length - 1);
      done.finish();
      view.node.replaceWith(done.node);
      if (failed !== null) showError(failed);
      showContext();
      scrollDown(false);
    }
    showSidebar();
    return { failed, produced };
  }

  async function send() {
    const text = el.prompt.value;
    if (!text.trim() || running) return;
    clearError();
    el.prompt.value = "";
    if (!conv) {
      const now = Date.now();
      const id = now.toString(36) + Math.random().toString(36).slice(2, 8);
      conv = { id, title: titleFrom(text), renamed: false, created: now, updated: now, messages: [] };
      store.set("current", id);
    }
    const target = conv;
    target.messages.push({ role: "user", content: text });
    touch(target);
    el.empty.hidden = true;
    const node = userNode(target.messages[target.messages.length - 1], target.messages.length - 1);
    el.messages.append(node);
    showSidebar();

    const { failed, produced } = await generate(target);
    if (failed === null || produced) return;
    // Nothing came back: forget the turn and put the text back so the user can retry.
    target.messages.pop();
    if (target.messages.length) touch(target);
    else chats.remove(target.id);
    if (target === conv) {
      node.remove();
      if (!target.messages.length) { conv = null; store.set("current", ""); el.empty.hidden = false; }
      if (!el.prompt.value) el.prompt.value = text;
      showError(failed);
    }
    showSidebar();
  }

  // Drop the reply at `index` and everything after it, then answer again.
  async function regenerate(index) {
    if (running || !conv) return;
    clearError();
    conv.messages.splice(index);
    touch(conv);
    showConversation();
    const { failed, produced } = await generate(conv);
    if (failed !== null && !produced) showError(failed);
  }

  // Replace the user turn at `index` with `text`, drop everything after it, then answer again.
  async function editAndRegenerate(index, text) {
    if (running || !conv) return;
    clearError();
    conv.messages.splice(index);
    conv.messages.push({ role: "user", content: text });
    touch(conv);
    showConversation();
    const { failed, produced } = await generate(conv);
    if (failed !== null && !produced) showError(failed);
  }

  // --- wiring --------------------------------------------------------------------------------------------
  el.send.addEventListener("click", send);
  el.stop.addEventListener("click", stopRunning);
  el.newChat.addEventListener("click", newChat);
  el.exportAll.addEventListener("click", () => download("mtpserve-conversations", chats.list()));
  el.toggleSidebar.addEventListener("click", () => document.body.classList.toggle("sidebar-open"));
  el.prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  // Copy buttons on code blocks are made by renderMarkdown, many times while a reply streams: one listener.
  el.messages.addEventListener("click", (e) => {
    const btn = e.target.closest && e.target.closest("button.copy-code");
    const block = btn && btn.closest(".code-block");
    const code = block && block.querySelector("pre code");
    if (code) copyText(code.textContent, btn);
  });

  // For tests and debugging: show `markdown` (and `reasoning`) as a finished reply would be, outside any
  // conversation; returns the message element.
  window.mtpRender = (markdown, reasoning = "") => {
    const msg = { role: "assistant", content: String(markdown) };
    if (reasoning) msg.reasoning = String(reasoning);
    const view = new AssistantView(msg, null);
    view.finish();
    el.empty.hidden = true;
    el.messages.append(view.node);
    return view.node;
  };

  const current = store.get("current");
  conv = current ? chats.load(current) : null;
  showConversation();
  loadServerInfo();
  el.prompt.focus();
})();
