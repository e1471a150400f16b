"""``eval report --html``: one self-contained page with the report's table and plots and a
question browser that sets the runs' trajectories side by side, turn by turn.

Nothing is fetched when the page opens (no CDN, no fonts, no external scripts): the plots are
PNG data URIs and the runs travel inside the page as JSON, rendered by a short inline script
that only ever sets ``textContent``, so a passage or an answer is text, never markup.
"""

from __future__ import annotations

import base64
import html
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memsearcher.errors import MemSearcherError
from memsearcher.eval.predictions import latest_records, read_predictions
from memsearcher.eval.report import (
    LEFT_ALIGNED,
    dataset_order,
    draw_objective_plots,
    draw_token_plots,
    table_cells,
)

__all__ = ["embed_json", "page_data", "render_html", "write_html"]

HIT_CHARS = 240
"""Each hit's text is cut to this many characters: the browser shows which passage came back,
and ~200 questions x several runs x 5 turns x 5 hits stay a few megabytes."""


def embed_json(data: Any) -> str:
    """JSON that is safe inside ``<script type="application/json">``: ``<``, ``>`` and ``&``
    become escapes, so no string in it can close the tag (``</script>``) or open a comment
    (``<!--``); `json.loads` reads the same value back."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    # U+2028/9 are valid in JSON but were line breaks in older JavaScript
    for raw, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                         ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):  # fmt: skip
        text = text.replace(raw, escaped)
    return text


def _turn(turn: dict[str, Any]) -> dict[str, Any]:
    """What the browser shows of a turn: no token ids, the hits cut to `HIT_CHARS`."""
    return {
        "thought": turn.get("thought"),
        "query": turn.get("query"),
        "hits": [
            {"title": h.get("title", ""), "text": (h.get("text") or "")[:HIT_CHARS]}
            for h in turn.get("hits") or ()
        ],
        "memory": turn.get("memory"),
        "answer": turn.get("answer"),
        "error": turn.get("error"),
        "prompt_tokens": turn.get("prompt_tokens"),
        "generated_tokens": turn.get("generated_tokens"),
        # a turn that neither searched nor answered shows what the model wrote instead
        "action": None if turn.get("query") or turn.get("answer") else turn.get("action_text"),
    }


def _record(record: dict[str, Any]) -> dict[str, Any]:
    trajectory = record.get("trajectory") or {}
    return {
        "prediction": record.get("prediction"),
        "em": record.get("em"),
        "f1": record.get("f1"),
        "end_reason": record.get("end_reason"),
        "error": record.get("error") or trajectory.get("error"),
        "turns": [_turn(t) for t in trajectory.get("turns") or ()],
    }


def page_data(runs: Sequence[str | Path]) -> dict[str, Any]:
    """The runs and every question any of them answered, each with one record a run (None
    where a run lacks it), questions ordered by dataset and then as first seen."""
    labels, agents = [], []
    questions: dict[tuple[str, str], dict[str, Any]] = {}
    for n, run in enumerate(runs):
        folder = Path(run)
        summary_path = folder / "summary.json"
        if not summary_path.is_file():
            raise MemSearcherError(f"{run}: no summary.json (is it an eval --out folder?)")
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
        labels.append(folder.name or str(run))
        agents.append(summary.get("settings", {}).get("agent"))
        for dataset in sorted(summary.get("datasets", {}), key=dataset_order):
            for record in latest_records(read_predictions(folder / dataset / "predictions.jsonl")):
                entry = questions.setdefault(
                    (dataset, str(record["id"])),
                    {
                        "dataset": dataset,
                        "id": str(record["id"]),
                        "question": record.get("question", ""),
                        "gold": record.get("golden_answers", []),
                        "runs": [None] * len(runs),
                    },
                )
                entry["runs"][n] = _record(record)
    ordered = sorted(questions.values(), key=lambda q: dataset_order(q["dataset"]))
    return {"runs": [{"label": a, "agent": b} for a, b in zip(labels, agents, strict=True)],
            "questions": ordered}  # fmt: skip


def _table(rows: Sequence[dict[str, Any]]) -> str:
    cells = table_cells(rows)
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cells[0])
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="{"l" if i < LEFT_ALIGNED else "r"}">{html.escape(c)}</td>'
            for i, c in enumerate(line)
        )
        + "</tr>"
        for line in cells[1:]
    )
    return f'<table class="metrics"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _plots(rows: Sequence[dict[str, Any]]) -> str:
    """The report's PNG plots as data URIs; a note instead when matplotlib is missing."""
    try:
        with tempfile.TemporaryDirectory() as folder:
            paths = draw_token_plots(rows, folder) + draw_objective_plots(rows, folder)
            images = [(p.stem, base64.b64encode(p.read_bytes()).decode("ascii")) for p in paths]
    except MemSearcherError as error:
        return f'<p class="note">{html.escape(str(error))}</p>'
    return "".join(
        f'<img alt="{html.escape(name)}" src="data:image/png;base64,{data}">'
        for name, data in images
    )


def render_html(rows: Sequence[dict[str, Any]], data: dict[str, Any], plots: bool = True) -> str:
    """The whole page: title, metrics table, plots, the question browser and its data."""
    labels = ", ".join(run["label"] for run in data["runs"])
    return PAGE.format(
        title=html.escape(f"memsearcher eval report: {labels}"),
        table=_table(rows),
        plots=_plots(rows) if plots else "",
        count=len(data["questions"]),
        data=embed_json(data),
        style=STYLE,
        script=SCRIPT,
    )


def write_html(
    rows: Sequence[dict[str, Any]], runs: Sequence[str | Path], out: str | Path, plots: bool = True
) -> Path:
    out = Path(out)
    if out.parent != Path():
        out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(rows, page_data(runs), plots), encoding="utf-8")
    return out


PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>{style}</style>
</head>
<body>
<h1>{title}</h1>
<h2>Metrics</h2>
{table}
<div class="plots">{plots}</div>
<h2>Questions ({count})</h2>
<div class="browser">
<div class="list">
<input id="filter" type="search" placeholder="filter: words of the question, dataset or id">
<div id="questions"></div>
</div>
<div id="detail"><p class="note">Pick a question.</p></div>
</div>
<script id="report-data" type="application/json">{data}</script>
<script>{script}</script>
</body>
</html>
"""

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1em 2em;color:#222}
table.metrics{border-collapse:collapse;font-variant-numeric:tabular-nums}
table.metrics th,table.metrics td{border-bottom:1px solid #ddd;padding:2px 8px}
td.r{text-align:right}td.l{text-align:left}
.plots img{max-width:48%;margin:4px}
.browser{display:flex;gap:1em;align-items:flex-start}
.list{width:28em;flex:none}
#filter{width:100%;box-sizing:border-box;margin-bottom:4px}
#questions{max-height:80vh;overflow-y:auto;border:1px solid #ddd}
.q{padding:3px 6px;cursor:pointer;border-bottom:1px solid #eee}
.q:hover{background:#f3f6fb}.q.on{background:#dfe8f7}
.em{display:inline-block;min-width:1.6em;margin-right:2px;text-align:center;font-size:11px;
border-radius:3px;background:#eee}
.em.y{background:#bfe5bf}.em.n{background:#f3c9c9}
#detail{flex:1;overflow-x:auto}
.runs{display:grid;gap:8px}
.run{border:1px solid #ccc;border-radius:4px;padding:6px;min-width:16em}
.turn{border-top:1px solid #ddd;padding:4px 0}
.label{color:#666;font-size:12px}
.bar{height:8px;background:#6b8fd6;border-radius:2px}
.mem{white-space:pre-wrap;background:#fafafa;padding:2px}
ins{background:#c9efc9;text-decoration:none}del{background:#f6d0d0}
.hit{font-size:12px}.hit b{font-weight:600}
.ok{color:#1a7f1a}.bad{color:#b02020}.note{color:#666}
"""

SCRIPT = """
"use strict";
const data = JSON.parse(document.getElementById("report-data").textContent);
const list = document.getElementById("questions");
const detail = document.getElementById("detail");
function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined && text !== null) node.textContent = String(text);
  return node;
}
function emBadge(record) {
  if (!record) return el("span", "em", "-");
  return el("span", "em " + (record.em > 0 ? "y" : "n"), Math.round(record.em * 100));
}
// word diff of two memories by longest common subsequence: kept, <ins> added, <del> dropped
function diffWords(before, after) {
  const a = before ? before.split(/\\s+/).filter(Boolean) : [];
  const b = after.split(/\\s+/).filter(Boolean);
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
function renderTurn(turn, t, previous, widest) {
  const box = el("div", "turn");
  box.appendChild(el("div", "label", "turn " + (t + 1) + " \\u00b7 context " +
    turn.prompt_tokens + " tokens, generated " + turn.generated_tokens));
  const bar = el("div", "bar");
  bar.style.width = (100 * (turn.prompt_tokens || 0) / widest).toFixed(1) + "%";
  box.appendChild(bar);
  field(box, "thought", turn.thought);
  field(box, "query", turn.query);
  for (const hit of turn.hits) {
    const line = el("div", "hit");
    line.appendChild(el("b", null, hit.title));
    line.append(" " + hit.text);
    box.appendChild(line);
  }
  if (turn.memory !== null && turn.memory !== undefined) {
    box.appendChild(el("div", "label", "memory (green: new, red: dropped)"));
    box.appendChild(diffWords(previous, turn.memory));
  }
  field(box, "wrote", turn.action);
  field(box, "answer", turn.answer);
  field(box, "error", turn.error);
  return box;
}
function show(q, row) {
  for (const node of list.querySelectorAll(".q.on")) node.classList.remove("on");
  row.classList.add("on");
  detail.replaceChildren();
  detail.appendChild(el("h3", null, q.question));
  detail.appendChild(el("div", "label", q.dataset + " \\u00b7 " + q.id + " \\u00b7 gold: " +
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
    verdict.textContent = "answer: " + (record.prediction ?? "(none)") + " \\u00b7 EM " +
      record.em + " \\u00b7 F1 " + (record.f1 ?? 0).toFixed(2) + " \\u00b7 " + record.end_reason;
    col.appendChild(verdict);
    field(col, "error", record.error);
    let previous = "";
    record.turns.forEach((turn, t) => {
      col.appendChild(renderTurn(turn, t, previous, widest));
      if (turn.memory !== null && turn.memory !== undefined) previous = turn.memory;
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
  const words = event.target.value.toLowerCase().split(/\\s+/).filter(Boolean);
  for (const [row, text] of rows) row.hidden = !words.every((w) => text.includes(w));
});
if (rows.length) show(data.questions[0], rows[0][0]);
"""
