"use strict";
// The trajectory viewer at `memsearcher serve`'s `/`: a question goes to POST /v1/answer with
// "stream": true, and each turn is drawn as its line of newline-delimited JSON arrives
// (turns.js), then the answer. The bars are rescaled to the widest context so far, so
// MemSearcher's flat context and ReAct's growing one show as they happen.
const form = document.getElementById("ask");
const input = document.getElementById("question");
const agentLabel = document.getElementById("agent");
const statusLine = document.getElementById("status");
const turnsBox = document.getElementById("turns");
const answerBox = document.getElementById("answer");
let agent = null;
let asking = null;  // the AbortController of the question on screen

async function health() {
  const response = await fetch("/health");
  const body = await response.json();
  agent = body.agent;
  agentLabel.textContent = "agent " + body.agent + " \u00b7 model " + body.model;
}

function detailOf(body, status) {
  const detail = body && body.detail !== undefined ? body.detail : "HTTP " + status;
  return typeof detail === "string" ? detail : JSON.stringify(detail);
}

// The response body's lines, parsed, as they arrive.
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, end).trim();
      buffer = buffer.slice(end + 1);
      if (line) yield JSON.parse(line);
    }
  }
  if (buffer.trim()) yield JSON.parse(buffer);
}

function showAnswer(result) {
  answerBox.className = result.answer !== null ? "done" : "bad";
  answerBox.replaceChildren();
  answerBox.appendChild(el("div", "label", result.turns + " turns \u00b7 " + result.searches +
    " searches \u00b7 ended: " + result.end_reason));
  if (result.answer !== null) field(answerBox, "answer", result.answer);
  else field(answerBox, "no answer", result.error || result.end_reason);
}

function showError(text) {
  answerBox.className = "bad";
  answerBox.replaceChildren(el("div", null, "error: " + text));
}

async function ask(question) {
  if (asking) asking.abort();  // the server drops a question whose client leaves
  const controller = asking = new AbortController();
  turnsBox.replaceChildren();
  answerBox.replaceChildren();
  answerBox.className = "";
  statusLine.textContent = "thinking\u2026";
  const bars = [];
  let widest = 1, previous = "";
  try {
    if (agent === null) await health();
    const response = await fetch("/v1/answer", {
      method: "POST",
      headers: {"content-type": "application/json"},
      body: JSON.stringify({question: question, stream: true}),
      signal: controller.signal,
    });
    if (!response.ok) {
      showError(detailOf(await response.json().catch(() => null), response.status));
      return;
    }
    for await (const event of events(response)) {
      if (event.event === "turn") {
        const turn = event.turn;
        widest = Math.max(widest, turn.prompt_tokens || 0);
        const box = renderTurn(turn, turn.index, previous, agent, widest);
        previous = memoryOf(turn, agent) ?? previous;
        bars.push(box.querySelector(".bar"));
        for (const bar of bars) setBar(bar, widest);
        turnsBox.appendChild(box);
        statusLine.textContent = "turn " + (turn.index + 1) + " done, thinking\u2026";
      } else if (event.event === "result") {
        showAnswer(event.result);
      } else {
        showError(event.detail);
      }
    }
  } catch (error) {
    if (error.name !== "AbortError") showError(String(error));
  } finally {
    if (asking === controller) {
      asking = null;
      statusLine.textContent = "";
    }
  }
}

form.addEventListener("submit", (event) => {
  event.preventDefault();
  const question = input.value.trim();
  if (!question) return;
  history.replaceState(null, "", "?q=" + encodeURIComponent(question));
  ask(question);
});
health().catch((error) => showError("the server did not answer: " + error));
const asked = new URLSearchParams(location.search).get("q");
if (asked) {
  input.value = asked;
  ask(asked);
}
