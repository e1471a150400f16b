"use strict";
// `eval report --html`'s question browser: pick a question, see each run's trajectory turn by
// turn, side by side (turns.js draws the turns). The runs travel in the page as JSON.
const data = JSON.parse(document.getElementById("report-data").textContent);
const list = document.getElementById("questions");
const detail = document.getElementById("detail");

function emBadge(record) {
  if (!record) return el("span", "em", "-");
  return el("span", "em " + (record.em > 0 ? "y" : "n"), Math.round(record.em * 100));
}

function show(q, row) {
  for (const node of list.querySelectorAll(".q.on")) node.classList.remove("on");
  row.classList.add("on");
  detail.replaceChildren();
  detail.appendChild(el("h3", null, q.question));
  detail.appendChild(el("div", "label", q.dataset + " \u00b7 " + q.id + " \u00b7 gold: " +
    q.gold.join(" | ")));
  let widest = 1;
  for (const r of q.runs) {
    if (r) for (const t of r.turns) widest = Math.max(widest, t.prompt_tokens || 0);
  }
  const grid = el("div", "runs");
  grid.style.gridTemplateColumns = "repeat(" + q.runs.length + ", minmax(16em, 1fr))";
  q.runs.forEach((record, n) => {
    const col = el("div", "run");
    col.dataset.run = data.runs[n].label;
    const run = data.runs[n];
    col.appendChild(el("h4", null, run.label + (run.agent ? " (" + run.agent + ")" : "")));
    grid.appendChild(col);
    if (!record) { col.appendChild(el("p", "note", "not in this run")); return; }
    const verdict = el("div", record.em > 0 ? "ok" : "bad");
    verdict.textContent = "answer: " + (record.prediction ?? "(none)") + " \u00b7 EM " +
      record.em + " \u00b7 F1 " + (record.f1 ?? 0).toFixed(2) + " \u00b7 " + record.end_reason;
    col.appendChild(verdict);
    field(col, "error", record.error);
    let previous = "";
    record.turns.forEach((turn, t) => {
      col.appendChild(renderTurn(turn, t, previous, run.agent, widest));
      previous = memoryOf(turn, run.agent) ?? previous;
    });
  });
  detail.appendChild(grid);
}

const rows = data.questions.map((q) => {
  const row = el("div", "q");
  for (const record of q.runs) row.appendChild(emBadge(record));
  row.append(" " + q.question);
  row.title = q.dataset + " / " + q.id;
  row.addEventListener("click", () => show(q, row));
  list.appendChild(row);
  return [row, (q.question + " " + q.dataset + " " + q.id).toLowerCase()];
});
document.getElementById("filter").addEventListener("input", (event) => {
  const words = event.target.value.toLowerCase().split(/\s+/).filter(Boolean);
  for (const [row, text] of rows) row.hidden = !words.every((w) => text.includes(w));
});
if (rows.length) show(data.questions[0], rows[0][0]);
