// polar_gym trace viewer. Run data (model output, tool output, task ids) is hostile: it is only ever inserted with
// textContent / DOM properties, never as HTML. The page is served under a CSP with no inline script.
"use strict";

(function () {
  const $ = (sel) => document.querySelector(sel);

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function fmt(value, digits) {
    if (value === null || value === undefined) return "";
    if (typeof value === "number") return digits === undefined ? String(value) : value.toFixed(digits);
    return String(value);
  }

  function showError(message) {
    const box = $("#error");
    box.textContent = message;
    box.hidden = !message;
  }

  async function getJSON(path) {
    const resp = await fetch(path, { credentials: "same-origin", headers: { Accept: "application/json" } });
    if (!resp.ok) {
      let message = resp.status + " " + resp.statusText;
      try { message = (await resp.json()).error.message || message; } catch (e) { /* not JSON */ }
      throw new Error(message);
    }
    return resp.json();
  }

  // -- the sessions table ----------------------------------------------------------------------------------------

  const form = $("#filters");
  let optionsFilled = false;

  function fillSelect(name, values) {
    const select = form.elements[name];
    for (const value of values) {
      const option = el("option", null, value);
      option.value = value;
      select.appendChild(option);
    }
  }

  function query() {
    const params = new URLSearchParams();
    for (const name of ["status", "task", "harness", "cause", "reward", "reward_min", "reward_max"]) {
      const value = form.elements[name].value.trim();
      if (value !== "") params.set(name, value);
    }
    return params;
  }

  async function loadSessions() {
    const params = query();
    const data = await getJSON("api/sessions?" + params.toString());
    if (!optionsFilled) {
      fillSelect("status", data.options.status);
      fillSelect("harness", data.options.harness);
      fillSelect("cause", data.options.error_cause);
      const list = $("#task-options");
      for (const task of data.options.task_id) { const o = el("option"); o.value = task; list.appendChild(o); }
      optionsFilled = true;
    }
    $("#count").textContent = data.matched + " of " + data.total + " sessions" +
      (data.sessions.length < data.matched ? " (first " + data.sessions.length + " shown)" : "");
    const body = $("#sessions tbody");
    const rows = document.createDocumentFragment();
    for (const s of data.sessions) {
      const tr = el("tr");
      tr.dataset.session = s.session_id;
      const cells = [s.session_id, s.task_id, fmt(s.sample_index), s.harness, s.status, fmt(s.reward),
        s.error_cause || "", fmt(s.traces), fmt(s.completions), fmt(s.seconds, 1)];
      cells.forEach((text, i) => {
        const td = el("td", i === 4 ? "status-" + s.status : null, text);
        if (i === 6 && s.reason) td.title = s.reason;
        tr.appendChild(td);
      });
      tr.addEventListener("click", () => { location.hash = "#/session/" + encodeURIComponent(s.session_id); });
      rows.appendChild(tr);
    }
    body.replaceChildren(rows);
  }

  let pending = null;
  function refilter() {
    clearTimeout(pending);
    pending = setTimeout(() => loadSessions().catch((e) => showError(e.message)), 150);
  }
  form.addEventListener("input", refilter);
  form.addEventListener("change", refilter);
  form.addEventListener("reset", () => setTimeout(refilter, 0));
  form.addEventListener("submit", (e) => { e.preventDefault(); refilter(); });
  $("#refresh").addEventListener("click", refilter);  // a live run: sessions finish while the page is open

  // -- one session ------------------------------------------------------------------------------------------------

  function fact(dl, name, value) {
    if (value === null || value === undefined || value === "") return;
    dl.appendChild(el("dt", null, name));
    dl.appendChild(el("dd", null, typeof value === "string" ? value : JSON.stringify(value)));
  }

  function prettyArguments(raw) {
    if (typeof raw !== "string") return JSON.stringify(raw, null, 2);
    try { return JSON.stringify(JSON.parse(raw), null, 2); } catch (e) { return raw; }
  }

  function contentText(content) {
    if (content === null || content === undefined) return "";
    if (typeof content === "string") return content;
    if (Array.isArray(content)) {
      return content.map((part) => (part && typeof part.text === "string") ? part.text : JSON.stringify(part))
        .join("\n");
    }
    return JSON.stringify(content);
  }

  // An image is shown only as what the proxy takes: a base64 picture of one of four types (an <img> never runs
  // script, and anything else in a run's files stays text).
  const IMAGE_URL = /^data:image\/(png|jpeg|gif|webp);base64,[A-Za-z0-9+\/=]+$/;

  function imageOf(url, title) {
    const img = document.createElement("img");
    img.className = "image";
    img.alt = "image";
    img.title = title;
    img.src = url;
    return img;
  }

  function renderContent(box, content) {
    if (!Array.isArray(content) || !content.some((part) => part && part.type === "image_url")) {
      const text = contentText(content);
      if (text) box.appendChild(el("pre", "content", text));
      return;
    }
    for (const part of content) {
      const url = part && part.type === "image_url" && part.image_url ? part.image_url.url : undefined;
      if (typeof url === "string" && IMAGE_URL.test(url)) box.appendChild(imageOf(url, "image"));
      else if (part && part.type === "image_url") box.appendChild(el("pre", "content", "[image " + String(url) + "]"));
      else if (contentText([part])) box.appendChild(el("pre", "content", contentText([part])));
    }
  }

  function renderMessage(msg) {
    const role = typeof msg.role === "string" ? msg.role : "?";
    const box = el("div", "msg role-" + role.replace(/[^a-z_]/gi, ""));
    const head = el("div");
    head.appendChild(el("span", "role", role));
    if (msg.tool_call_id) head.appendChild(el("span", "muted", " (" + msg.tool_call_id + ")"));
    box.appendChild(head);
    const reasoning = msg.reasoning_content || msg.reasoning;
    if (reasoning) box.appendChild(el("pre", "reasoning", contentText(reasoning)));
    renderContent(box, msg.content);
    for (const call of (Array.isArray(msg.tool_calls) ? msg.tool_calls : [])) {
      const fn = (call && call.function) || {};
      const div = el("div", "tool-call");
      div.appendChild(el("span", "name", "\u2192 " + (fn.name || "?") + "()"));
      if (call.id) div.appendChild(el("span", "muted", "  " + call.id));
      div.appendChild(el("pre", null, prettyArguments(fn.arguments)));
      box.appendChild(div);
    }
    return box;
  }

  // The token stream: one span per token, built from the arrays into one fragment, then inserted once. A token's
  // title (id, mask, logprob) is set when the pointer first reaches it: 40k title strings up front cost more than
  // the whole rest of the render.
  function tokenTitle(data, i) {
    const lp = data.logprobs[i];
    return "#" + i + " id " + data.ids[i] + " mask " + data.mask[i] +
      (lp === null || lp === undefined ? "" : " logprob " + lp);
  }

  function renderTokens(container, data) {
    const vocab = data.vocab;
    const marks = new Map();
    (data.spans || []).forEach((span, i) => {
      if (typeof span.start === "number") marks.set(data.prompt_len + span.start, { i, span });
    });
    // an image's placeholder tokens show as the image itself, beside the count of tokens it stands for
    const images = new Map();
    (data.images || []).forEach((image) => {
      if (Number.isInteger(image.start) && Number.isInteger(image.end) && image.end > image.start) {
        images.set(image.start, image);
      }
    });
    // Tokens go in blocks of a few hundred, each cut after a token that ends a line (so the text flows as one),
    // and styled content-visibility: auto: the browser lays out and paints only the blocks on screen.
    const frag = document.createDocumentFragment();
    const ids = data.ids, mask = data.mask;
    let firstResponse = null;
    let chunk = el("div", "chunk"), inChunk = 0;
    frag.appendChild(chunk);
    for (let i = 0; i < ids.length; i++) {
      const mark = marks.get(i);
      if (mark !== undefined) {
        const m = el("span", "call-mark", "\u25b8");
        m.title = "call " + mark.i + " " + (mark.span.completion_id || "") + " engine " + (mark.span.engine || "") +
          " policy " + fmt(mark.span.policy_version) + " tokens " + mark.span.start + "-" + mark.span.end;
        chunk.appendChild(m);
      }
      const image = images.get(i);
      if (image !== undefined) {
        const run = el("span", "image-run");
        const about = "image " + String(image.sha256 || "?").slice(0, 12) + ", tokens " + image.start + "-" +
          image.end + " (" + (image.end - image.start) + " placeholders)";
        if (typeof image.url === "string" && IMAGE_URL.test(image.url)) run.appendChild(imageOf(image.url, about));
        run.appendChild(el("span", "muted", "[" + about + "]"));
        chunk.appendChild(run);
        inChunk++;
        i = Math.min(image.end, ids.length) - 1;
        continue;
      }
      const id = ids[i];
      const span = document.createElement("span");
      span.className = mask[i] === 1 ? "t m1" : "t m0";
      const text = vocab ? vocab[id] : undefined;
      span.textContent = text !== undefined ? text : id + " ";
      span.tokenIndex = i;
      if (i === data.prompt_len && inChunk > 0) {  // the response starts a block: the view scrolls to it
        chunk = el("div", "chunk");
        frag.appendChild(chunk);
        inChunk = 0;
      }
      if (i === data.prompt_len) firstResponse = chunk;
      chunk.appendChild(span);
      inChunk++;
      if ((inChunk >= 400 && span.textContent.endsWith("\n")) || inChunk >= 2000) {
        chunk = el("div", "chunk");
        frag.appendChild(chunk);
        inChunk = 0;
      }
    }
    container.onmouseover = (event) => {
      const target = event.target;
      if (target.tokenIndex !== undefined && !target.title) target.title = tokenTitle(data, target.tokenIndex);
    };
    container.replaceChildren(frag);
    return firstResponse;
  }

  async function loadTokens(sessionId, index, container, button) {
    button.disabled = true;
    button.textContent = "loading tokens\u2026";
    const data = await getJSON("api/sessions/" + encodeURIComponent(sessionId) + "/traces/" + index + "/tokens");
    const firstResponse = renderTokens(container, data);
    container.hidden = false;
    button.remove();
    // the prompt is long and the same in every trace: start the view where this trace's response starts (the
    // block's box, not a token's: tokens of blocks off screen are not laid out)
    if (firstResponse) container.scrollTop = Math.max(0, firstResponse.offsetTop - container.offsetTop);
  }

  function renderTrace(sessionId, trace, auto) {
    const box = el("section", "trace");
    box.dataset.trace = trace.index;
    const head = el("div", "chain-boundary");
    head.appendChild(document.createTextNode("trace " + trace.index + " \u00b7 chain " + fmt(trace.chain) +
      " \u00b7 started by: "));
    head.appendChild(el("span", "cause", trace.chain_cause || "?"));
    head.appendChild(el("span", "muted", "  (" + trace.prompt_tokens + " prompt + " + trace.response_tokens +
      " response tokens, " + trace.trainable_tokens + " trainable; finish " + fmt(trace.finish_reason) +
      "; reward " + fmt(trace.reward) + (trace.side_request ? "; side request" : "") + ")"));
    box.appendChild(head);
    const prompt = el("details", "prompt");
    prompt.appendChild(el("summary", null, trace.prompt_messages + " prompt messages"));
    box.appendChild(prompt);
    let promptRendered = false;
    prompt.addEventListener("toggle", () => {
      if (promptRendered || !prompt.open) return;
      promptRendered = true;
      getJSON("api/sessions/" + encodeURIComponent(sessionId) + "/traces/" + trace.index + "/prompt").then((data) => {
        const frag = document.createDocumentFragment();
        data.prompt_messages.forEach((m) => frag.appendChild(renderMessage(m)));
        if (data.tools.length) {
          const names = data.tools.map((t) => (t && t.function && t.function.name) || (t && t.name) || "?");
          frag.appendChild(el("p", "muted", "tools: " + names.join(", ")));
        }
        prompt.appendChild(frag);
      }).catch((e) => showError(e.message));
    });
    const responses = document.createDocumentFragment();
    trace.response_messages.forEach((m) => responses.appendChild(renderMessage(m)));
    box.appendChild(responses);
    const tokens = el("div", "tokens");
    tokens.hidden = true;
    const button = el("button", "load", "show tokens");
    button.type = "button";
    button.addEventListener("click", () => loadTokens(sessionId, trace.index, tokens, button)
      .catch((e) => showError(e.message)));
    box.appendChild(button);
    box.appendChild(tokens);
    if (auto) loadTokens(sessionId, trace.index, tokens, button).catch((e) => showError(e.message));
    return box;
  }

  function renderChains(container, data) {
    const d = data.diagnostics || {};
    const parts = [];
    parts.push((d.chains !== undefined ? d.chains : data.traces.length) + " chain(s)");
    const breaks = d.breaks || {};
    const names = Object.keys(breaks);
    parts.push(names.length ? "breaks: " + names.map((k) => k + " \u00d7" + JSON.stringify(breaks[k])).join(", ")
      : "no breaks");
    if (d.completions_merged !== undefined) parts.push(d.completions_merged + " completions merged");
    if (d.rerender_merged) parts.push(d.rerender_merged + " merged over a re-rendering");
    container.replaceChildren(el("p", null, parts.join("; ")));
    const list = el("ul", "chain-list");
    for (const t of data.traces) {
      list.appendChild(el("li", null, "trace " + t.index + ": chain " + fmt(t.chain) + ", cause " +
        (t.chain_cause || "?")));
    }
    container.appendChild(list);
  }

  async function openSession(sessionId) {
    $("#sessions-view").hidden = true;
    $("#session-view").hidden = false;
    $("#session-title").textContent = sessionId;
    $("#traces").replaceChildren();
    const data = await getJSON("api/sessions/" + encodeURIComponent(sessionId));
    const row = data.row;
    $("#session-title").textContent = row.session_id + "  (" + row.status + ")";
    const dl = $("#session-facts");
    dl.replaceChildren();
    fact(dl, "task", row.task_id + (row.sample_index !== null ? " #" + row.sample_index : ""));
    fact(dl, "harness", row.harness);
    fact(dl, "reward", fmt(row.reward));
    fact(dl, "error cause", row.error_cause);
    fact(dl, "reason", data.reason);
    if (data.harness_run) fact(dl, "harness run", data.harness_run);
    fact(dl, "timings (s)", Object.entries(data.timings).map(([k, v]) => k + " " + fmt(v, 3)).join(", "));
    if (data.status_history.length) {
      const t0 = data.status_history[0].at;
      fact(dl, "status history", data.status_history.map((h) => h.status + " +" +
        (typeof h.at === "number" ? (h.at - t0).toFixed(2) : "?") + "s").join(" \u2192 "));
    }
    renderChains($("#chains"), data);
    const calls = document.createDocumentFragment();
    for (const c of data.calls) {
      const tr = el("tr");
      [fmt(c.index), c.completion_id, fmt(c.trace), c.span ? c.span.join("\u2013") : "", c.engine, c.server,
        c.policy_version === null || c.policy_version === undefined ? "none" : fmt(c.policy_version), c.prompt_mode, (c.status || "") + (c.error ? ": " + c.error : "") +
        (c.side_request ? " (side)" : ""), fmt(c.offset_seconds, 3), fmt(c.upstream_seconds, 3),
        fmt(c.total_seconds, 3), fmt(c.prompt_tokens), fmt(c.response_tokens)]
        .forEach((text) => tr.appendChild(el("td", null, text)));
      calls.appendChild(tr);
    }
    $("#calls tbody").replaceChildren(calls);
    const traces = document.createDocumentFragment();
    data.traces.forEach((t, i) => traces.appendChild(renderTrace(row.session_id, t, i === 0)));
    $("#traces").replaceChildren(traces);
  }

  // -- routing ----------------------------------------------------------------------------------------------------

  function route() {
    showError("");
    const match = location.hash.match(/^#\/session\/(.+)$/);
    if (match) {
      openSession(decodeURIComponent(match[1])).catch((e) => showError(e.message));
    } else {
      $("#session-view").hidden = true;
      $("#sessions-view").hidden = false;
      loadSessions().catch((e) => showError(e.message));
    }
  }

  window.addEventListener("hashchange", route);
  getJSON("api/run").then((run) => {
    $("#run-title").textContent = run.title;
    $("#run-tokenizer").textContent = run.tokenizer ? "tokens decoded with " + run.tokenizer : "token ids (no tokenizer)";
  }).catch((e) => showError(e.message));
  route();
})();
