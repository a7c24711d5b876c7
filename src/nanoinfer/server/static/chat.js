// nanoinfer's chat page: keeps the conversation, streams each answer from /v1/chat/completions over SSE,
// stops it (the server frees the request's row when the connection closes), regenerates the last answer.
// A turn that fails (an HTTP error, a dropped stream) stays on screen marked as failed but leaves the history,
// its message back in the box to send again; the next send or regenerate clears it.
// Tool calls arrive inside the text as <|python_start|>expr<|python_end|><|output_start|>result<|output_end|>
// and are shown as chips.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { history: [], controller: null, model: null };   // history: [{role, content}]

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  const last = state.history[state.history.length - 1];
  $("regenerate").disabled = busy || !last || last.role !== "assistant";
}

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: `Bearer ${key}` } : {};
}

function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `message ${role}`;
  div.dataset.state = role === "assistant" ? "streaming" : "done";
  render(div, text);
  $("messages").appendChild(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

// Text with tool spans as chips: built from text nodes, so nothing the model writes is parsed as HTML.
function render(div, text) {
  div.replaceChildren();
  const parts = text.split(/(<\|python_start\|>[\s\S]*?(?:<\|python_end\|>|$)|<\|output_start\|>[\s\S]*?(?:<\|output_end\|>|$))/);
  for (const part of parts) {
    if (!part) continue;
    const call = part.match(/^<\|python_start\|>([\s\S]*?)(<\|python_end\|>)?$/);
    const result = part.match(/^<\|output_start\|>([\s\S]*?)(<\|output_end\|>)?$/);
    if (call || result) {
      const chip = document.createElement("span");
      chip.className = "tool";
      chip.textContent = call ? `calculator: ${call[1]}` : `= ${result[1]}`;
      div.appendChild(chip);
    } else {
      div.appendChild(document.createTextNode(part));
    }
  }
}

function finish(div, stateName, note) {
  div.dataset.state = stateName;
  if (note) {
    const span = document.createElement("span");
    span.className = "note";
    span.textContent = note;
    div.appendChild(span);
  }
}

// Stream one answer to the current history; its text goes into the history as far as it got, unless it
// failed: then the failed exchange leaves the history (never sent again as an empty or partial answer).
async function answer() {
  clearFailed();
  const div = addMessage("assistant", "");
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  let text = "";
  let ending = { state: "done", note: "" };
  const body = {
    messages: state.history, stream: true,
    temperature: Number($("temperature").value),
    top_k: Math.max(0, Math.floor(Number($("top-k").value) || 0)),
  };
  // empty: as many as the context leaves (the server refuses more than that)
  if ($("max-tokens").value) body.max_tokens = Math.max(1, Math.floor(Number($("max-tokens").value) || 1));
  if (state.model) body.model = state.model;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", signal: controller.signal,
      headers: { "Content-Type": "application/json", ...authHeaders() }, body: JSON.stringify(body),
    });
    if (!response.ok) {
      const detail = await response.json().catch(() => ({}));
      throw new Error(detail.error ? detail.error.message : `HTTP ${response.status}`);
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        if (!event.startsWith("data: ") || event === "data: [DONE]") continue;
        const chunk = JSON.parse(event.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        for (const choice of chunk.choices) {
          text += choice.delta.content || "";
          if (choice.finish_reason === "length") ending = { state: "done", note: "(stopped at the token limit)" };
        }
        render(div, text);
        div.scrollIntoView({ block: "end" });
      }
    }
  } catch (error) {
    ending = error.name === "AbortError" ? { state: "stopped", note: "(stopped)" }
                                         : { state: "error", note: `error: ${error.message}` };
    if (ending.state === "error") div.classList.add("error");
  }
  if (ending.state === "error") {
    failTurn(div);
  } else {
    state.history.push({ role: "assistant", content: text });
  }
  finish(div, ending.state, ending.note);
  state.controller = null;
  setBusy(false);
}

// The failed answer and the user message it answered: out of the history, marked on screen, and the
// message back in the box (unless something new was typed meanwhile).
function failTurn(answerDiv) {
  answerDiv.classList.add("failed");
  const turn = state.history[state.history.length - 1];
  if (!turn || turn.role !== "user") return;
  state.history.pop();
  const users = $("messages").querySelectorAll(".message.user");
  users[users.length - 1].classList.add("failed");
  if (!$("prompt").value) $("prompt").value = turn.content;
}

function clearFailed() {
  for (const div of $("messages").querySelectorAll(".message.failed")) div.remove();
}

function send(event) {
  event.preventDefault();
  const message = $("prompt").value.trim();
  if (!message || state.controller) return;
  $("prompt").value = "";
  clearFailed();
  state.history.push({ role: "user", content: message });
  addMessage("user", message);
  answer();
}

function regenerate() {
  if (state.controller || state.history[state.history.length - 1]?.role !== "assistant") return;
  clearFailed();
  state.history.pop();
  const bubbles = $("messages").querySelectorAll(".message.assistant");
  bubbles[bubbles.length - 1].remove();
  answer();
}

$("composer").addEventListener("submit", send);
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey) send(event);
});
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("regenerate").addEventListener("click", regenerate);
$("clear").addEventListener("click", () => {
  if (state.controller) state.controller.abort();
  state.history = [];
  $("messages").replaceChildren();
  setBusy(false);
});
$("temperature").addEventListener("input", () => { $("temperature-value").textContent = $("temperature").value; });
$("api-key").addEventListener("change", loadModel);

// The served model's name; asked again whenever the API key changes (a server with a key refuses it without).
async function loadModel() {
  try {
    const response = await fetch("/v1/models", { headers: authHeaders() });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    state.model = (await response.json()).data[0].id;
    $("model").textContent = state.model;
  } catch {
    state.model = null;
    $("model").textContent = "(model unknown)";
  }
}
loadModel();
