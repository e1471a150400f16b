"use strict";
// One turn of a trajectory, drawn the same way by the trajectory viewer (`memsearcher serve`'s
// page) and by `eval report --html`: thought, query, hits, the memory with what changed since
// the turn before, and the context the model saw as a bar. Text only ever goes in through
// textContent, so a passage or an answer can never become markup.
const HIT_CHARS = 240;

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}

// word diff of two memories by longest common subsequence: kept, <ins> added, <del> dropped
function diffWords(before, after) {
  const a = before ? before.split(/\s+/).filter(Boolean) : [];
  const b = after.split(/\s+/).filter(Boolean);
  const n = a.length, m = b.length;
  const L = Array.from({length: n + 1}, () => new Int32Array(m + 1));
  for (let i = n - 1; i >= 0; i--)
    for (let j = m - 1; j >= 0; j--)
      L[i][j] = a[i] === b[j] ? L[i + 1][j + 1] + 1 : Math.max(L[i + 1][j], L[i][j + 1]);
  const out = el("div", "mem");
  let i = 0, j = 0;
  const put = (tag, word) => { out.appendChild(el(tag, null, word)); out.append(" "); };
  while (i < n || j < m) {
    if (i < n && j < m && a[i] === b[j]) { put("span", a[i]); i++; j++; }
    else if (j < m && (i === n || L[i][j + 1] >= L[i + 1][j])) { put("ins", b[j]); j++; }
    else { put("del", a[i]); i++; }
  }
  return out;
}

function field(parent, name, value) {
  if (value === null || value === undefined || value === "") return;
  const row = el("div");
  row.appendChild(el("span", "label", name + ": "));
  row.appendChild(el("span", null, value));
  parent.appendChild(row);
}

// What the agent carries from turn to turn: MemSearcher's memory, MEM1's internal state (its
// <think>, the only thing it keeps), or null for ReAct, whose context holds every earlier turn.
function memoryOf(turn, agent) {
  if (turn.memory !== null && turn.memory !== undefined) return turn.memory;
  if (agent === "mem1") return turn.thought || "";
  return null;
}

function setBar(bar, widest) {
  bar.style.width = (100 * Number(bar.dataset.tokens) / Math.max(widest, 1)).toFixed(1) + "%";
}

// A turn's box; `previous` is the memory before it, `widest` the context the bars are scaled to.
function renderTurn(turn, t, previous, agent, widest) {
  const box = el("div", "turn");
  box.appendChild(el("div", "label", "turn " + (t + 1) + " \u00b7 context " +
    turn.prompt_tokens + " tokens, generated " + turn.generated_tokens));
  const bar = el("div", "bar");
  bar.dataset.tokens = String(turn.prompt_tokens || 0);
  setBar(bar, widest);
  box.appendChild(bar);
  if (agent !== "mem1") field(box, "thought", turn.thought);
  if (turn.repeated_query) {
    field(box, "repeated", turn.repeated_query + " (searched before: answer asked for)");
  }
  field(box, "query", turn.query);
  for (const hit of turn.hits || []) {
    const line = el("div", "hit");
    line.appendChild(el("b", null, hit.title));
    line.append(" " + (hit.text || "").slice(0, HIT_CHARS));
    box.appendChild(line);
  }
  const memory = memoryOf(turn, agent);
  const kept = el("div", "memory");
  if (memory === null) {
    kept.appendChild(el("div", "label", "no memory: the context holds every earlier turn"));
  } else {
    const what = agent === "mem1" ? "internal state (its only memory)" : "memory";
    const unchanged = t > 0 && memory === previous;
    kept.appendChild(el("div", "label",
      what + (unchanged ? " (unchanged)" : " (green: new, red: dropped)")));
    kept.appendChild(diffWords(previous, memory));
  }
  box.appendChild(kept);
  // a turn that neither searched nor answered shows what the model wrote instead
  const wrote = turn.action !== undefined ? turn.action : turn.action_text;
  if (!turn.query && !turn.answer) field(box, "wrote", wrote);
  field(box, "answer", turn.answer);
  field(box, "error", turn.error);
  return box;
}
