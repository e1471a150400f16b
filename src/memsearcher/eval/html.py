"""``eval report --html``: one self-contained page with the report's table and plots and a
question browser that sets the runs' trajectories side by side, turn by turn.

Nothing is fetched when the page opens (no CDN, no fonts, no external scripts): the plots are
PNG data URIs and the runs travel inside the page as JSON, rendered by a short inline script
(``memsearcher/web``'s ``turns.js``, shared with ``serve``'s trajectory viewer, and
``report.js``) that only ever sets ``textContent``, so a passage or an answer is text, never
markup.
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
from memsearcher.web import asset

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
        "repeated_query": turn.get("repeated_query"),
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
        style=asset("style.css"),
        script=asset("turns.js") + asset("report.js"),
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
