// The playground: streams /v1/completions (or /v1/chat/completions when the model has a chat template)
// from the server that served this page. No dependencies, no build step, nothing from other hosts.
// Model output is only ever set as text (textContent / text nodes), never parsed as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "gptopt-api-key"; // sessionStorage: the key lives as long as this tab, never on disk for good

const state = { model: null, chat: false, messages: [], controller: null };

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = sessionStorage.getItem(KEY);
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

// The message of an OpenAI error body, or the HTTP status when the body is not one.
async function errorMessage(res) {
  try {
    const body = await res.json();
    if (body && body.error && body.error.message) return `${res.status}: ${body.error.message}`;
  } catch (e) { /* not JSON: fall through */ }
  return `${res.status} ${res.statusText}`;
}

async function loadModels() {
  $("status").textContent = "";
  let res;
  try {
    res = await fetch("/v1/models", { headers: headers() });
  } catch (e) {
    $("status").textContent = `cannot reach the server: ${e.message}`;
    document.body.dataset.models = "error";
    return;
  }
  if (res.status === 401) {
    const hadKey = Boolean(sessionStorage.getItem(KEY));
    $("key-section").hidden = false;
    $("model-name").textContent = "(needs the API key)";
    $("status").textContent = hadKey ? "The server refused this API key; enter the right one."
                                     : "This server needs an API key: enter it above.";
    document.body.dataset.models = "needs-key";
    return;
  }
  if (!res.ok) {
    $("status").textContent = `GET /v1/models failed: ${await errorMessage(res)}`;
    document.body.dataset.models = "error";
    return;
  }
  const card = (await res.json()).data[0];
  state.model = card.id;
  state.chat = card.chat === true; // gptopt's extension: the model has a chat template
  $("model-name").textContent = card.id;
  $("mode").hidden = !state.chat;
  $("chat-note").hidden = state.chat;
  if (sessionStorage.getItem(KEY)) $("key-section").hidden = false; // to change it
  setMode();
  document.body.dataset.models = "loaded";
}

function chatMode() {
  return state.chat && document.querySelector('input[name="mode"]:checked').value === "chat";
}

function setMode() {
  const chat = chatMode();
  $("prompt-label").textContent = chat ? "Message" : "Prompt";
  // an example of what each mode takes: a message to reply to, or the start of a text to continue
  $("prompt").placeholder = chat ? "Ask something, e.g. What is a transformer?" : "Once upon a time";
}

function number(id) {
  const v = $(id).value.trim();
  return v === "" ? undefined : Number(v); // empty: the server's default; anything else it checks
}

// One answer block: what was asked (completion mode), the streamed text, the stats, the error.
function newAnswer(prompt) {
  const article = document.createElement("article");
  article.className = "answer";
  article.dataset.state = "waiting";
  article.dataset.chunks = "0";
  const pre = document.createElement("pre");
  if (prompt !== null) {
    const p = document.createElement("span");
    p.className = "prompt";
    p.textContent = prompt;
    pre.append(p);
  }
  const text = document.createElement("span");
  text.className = "text";
  pre.append(text);
  const stats = document.createElement("p");
  stats.className = "stats";
  const error = document.createElement("p");
  error.className = "error";
  error.setAttribute("role", "alert");
  article.append(pre, stats, error);
  $("answers").append(article);
  return { article, text, stats, error };
}

function showUser(content) {
  const div = document.createElement("div");
  div.className = "user";
  const pre = document.createElement("pre");
  pre.textContent = content;
  div.append(pre);
  $("answers").append(div);
}

// POST `body` to `url` with stream: true, appending each delta to answer.text as it arrives.
// Returns "done", "stopped" or "error".
async function stream(url, body, answer, deltaOf) {
  const controller = new AbortController();
  state.controller = controller;
  const t0 = performance.now();
  let first = null, last = null, chunks = 0, tokens = null, outcome = "done";

  const onEvent = (data) => {
    if (data === "[DONE]") return true;
    const obj = JSON.parse(data);
    if (obj.error) throw new Error(obj.error.message); // the server failed mid-stream
    if (obj.usage) tokens = obj.usage.completion_tokens;
    const delta = obj.choices && obj.choices.length ? deltaOf(obj.choices[0]) : "";
    if (delta) {
      last = performance.now();
      if (first === null) first = last;
      answer.text.append(delta); // a text node: never HTML
      answer.article.dataset.chunks = String(++chunks);
      answer.article.dataset.state = "streaming";
    }
    return false;
  };

  try {
    const res = await fetch(url, { method: "POST", headers: headers(), body: JSON.stringify(body),
                                   signal: controller.signal });
    if (!res.ok) throw new Error(await errorMessage(res));
    const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "", finished = false;
    while (!finished) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value.replace(/\r/g, "");
      let end;
      while (!finished && (end = buffer.indexOf("\n\n")) >= 0) { // one SSE event per blank line
        const lines = buffer.slice(0, end).split("\n");
        buffer = buffer.slice(end + 2);
        const data = lines.filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
        if (data) finished = onEvent(data);
      }
    }
    if (!finished) throw new Error("the stream ended before [DONE]");
  } catch (e) {
    if (e.name === "AbortError") {
      outcome = "stopped";
    } else {
      outcome = "error";
      answer.error.textContent = e.message;
    }
  } finally {
    state.controller = null;
  }
  answer.article.dataset.state = outcome;
  if (first !== null) {
    const n = tokens ?? chunks; // the server's count when it sent usage; else one token a chunk
    const ttft = first - t0;
    // The decode rate: tokens after the first over the time after the first (TTFT is its own figure).
    const rate = n > 1 && last > first ? ((n - 1) * 1000) / (last - first) : null;
    answer.stats.textContent = `${n} tokens · TTFT ${ttft.toFixed(0)} ms · ` +
      (rate === null ? "— tokens/s" : `${rate.toFixed(1)} tokens/s`) + (outcome === "stopped" ? " · stopped" : "");
  } else if (outcome === "stopped") {
    answer.stats.textContent = "stopped before the first token";
  }
  return outcome;
}

async function send() {
  if (state.controller) return; // one request at a time
  const prompt = $("prompt").value;
  if (!prompt) { $("prompt").focus(); return; }
  const params = { temperature: number("temperature"), top_p: number("top_p"), max_tokens: number("max_tokens"),
                   stream: true, stream_options: { include_usage: true } };
  if (state.model) params.model = state.model;
  $("send").disabled = true;
  $("stop").disabled = false;
  $("clear").disabled = true; // a reply still streaming belongs to the conversation it was asked in
  try {
    if (chatMode()) {
      state.messages.push({ role: "user", content: prompt });
      showUser(prompt);
      $("prompt").value = "";
      const answer = newAnswer(null);
      const outcome = await stream("/v1/chat/completions", { ...params, messages: state.messages }, answer,
                                   (c) => (c.delta && c.delta.content) || "");
      if (outcome === "error") state.messages.pop(); // the turn did not happen; the user may resend it
      else state.messages.push({ role: "assistant", content: answer.text.textContent });
    } else {
      await stream("/v1/completions", { ...params, prompt }, newAnswer(prompt), (c) => c.text || "");
    }
  } finally {
    $("send").disabled = false;
    $("stop").disabled = true;
    $("clear").disabled = false;
  }
}

function useKey() {
  const key = $("api-key").value.trim();
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
  loadModels();
}

document.addEventListener("DOMContentLoaded", () => {
  $("send").addEventListener("click", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); send(); }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("clear").addEventListener("click", () => { state.messages = []; $("answers").replaceChildren(); });
  $("key-use").addEventListener("click", useKey);
  $("api-key").addEventListener("keydown", (e) => { if (e.key === "Enter") { e.preventDefault(); useKey(); } });
  document.querySelectorAll('input[name="mode"]').forEach((r) => r.addEventListener("change", setMode));
  loadModels();
});
