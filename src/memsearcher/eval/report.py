"""Compare evaluation runs: one table across runs and datasets, prompt tokens per turn, and,
for multi-objective runs (MEM1's tasks), peak tokens and EM against the number of objectives.

matplotlib is optional (``pip install 'memsearcher[eval]'``) and only imported to draw.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from memsearcher.data.flashrag import BENCHMARKS
from memsearcher.errors import MemSearcherError

__all__ = [
    "dataset_order",
    "draw_objective_plots",
    "draw_token_plots",
    "format_table",
    "load_rows",
    "paired_bootstrap",
    "paired_differences",
    "rows_from_summary",
    "table_cells",
]

COLUMNS = (
    ("run", "run", "{}"),
    ("dataset", "dataset", "{}"),
    ("agent", "agent", "{}"),
    ("questions", "n", "{}"),
    ("objectives", "N", "{:g}"),
    ("em", "EM", "{:.1f}"),
    ("f1", "F1", "{:.1f}"),
    ("acc", "ACC", "{:.1f}"),
    ("mean_turns", "turns", "{:.2f}"),
    ("searches_per_question", "searches", "{:.2f}"),
    ("tokens_p50", "tok p50", "{:.0f}"),
    ("tokens_p90", "tok p90", "{:.0f}"),
    ("tokens_max", "tok max", "{:.0f}"),
    ("peak_tokens", "peak tok", "{:.0f}"),
    ("seconds_per_question", "s/q", "{:.2f}"),
    ("format_failure_rate", "fmt fail", "{:.1%}"),
)
SHOP_COLUMNS = (
    ("reward", "reward", "{:.3f}"),
    ("success", "success", "{:.1%}"),
)
"""Added where a row has them: runs in a shop (``eval --env shop`` or ``webshop``)."""
PERCENT = frozenset({"em", "f1", "acc"})
"""In percent for one-objective rows; summed over N objectives (0..N, as MEM1 reports) else."""
LEFT_ALIGNED = 3  # run, dataset, agent


def dataset_order(name: str) -> tuple[int, str]:
    """Sort key: the seven benchmarks in their usual order, then any other dataset by name."""
    return (BENCHMARKS.index(name) if name in BENCHMARKS else len(BENCHMARKS), name)


def rows_from_summary(run: str | Path, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per dataset of one run, then an ``avg`` row when there are several."""
    label = Path(run).name or str(run)
    agent = summary.get("settings", {}).get("agent")
    rows = []
    for name in sorted(summary.get("datasets", {}), key=dataset_order):
        s = summary["datasets"][name]
        if not s.get("questions"):
            continue
        tokens = s["prompt_tokens_per_turn"]
        rows.append(
            {
                "run": label,
                "dataset": name,
                "agent": agent,
                **{k: s[k] for k in ("questions", "em", "f1", "acc", "mean_turns")},
                # summaries written before multi-objective runs have none of these three
                "objectives": s.get("objectives", 1.0),
                "peak_tokens": (s.get("peak_tokens") or {}).get("mean"),
                "seconds_per_question": s.get("seconds_per_question"),
                "searches_per_question": s["searches_per_question"],
                "tokens_p50": tokens["p50"],
                "tokens_p90": tokens["p90"],
                "tokens_max": tokens["max"],
                "format_failure_rate": s["format_failure_rate"],
                "prompt_tokens_by_turn": s["prompt_tokens_by_turn"],
                **_shop_cells(s.get("shop")),
            }
        )
    average = summary.get("average") or {}
    if len(rows) > 1 and average:
        rows.append({"run": label, "dataset": "avg", "agent": agent, **average})
    return rows


def _shop_cells(shop: dict[str, Any] | None) -> dict[str, Any]:
    if shop is None:
        return {}
    return {"reward": shop["mean_reward"], "success": shop["success_rate"]}


def load_rows(runs: Sequence[str | Path]) -> list[dict[str, Any]]:
    """Rows of every run folder's ``summary.json``."""
    rows = []
    for run in runs:
        path = Path(run) / "summary.json"
        if not path.is_file():
            raise MemSearcherError(f"{run}: no summary.json (is it an eval --out folder?)")
        try:
            summary = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise MemSearcherError(f"{path}: not JSON ({error.msg})") from None
        rows += rows_from_summary(run, summary)
    return rows


def table_cells(rows: Sequence[dict[str, Any]]) -> list[list[str]]:
    """The table as strings, the titles first: what `format_table` prints and the HTML report
    shows, so both carry the same numbers."""
    shop = any(row.get("reward") is not None for row in rows)
    columns = (*COLUMNS, *SHOP_COLUMNS) if shop else COLUMNS
    cells = [[title for _, title, _ in columns]]
    for row in rows:
        line = []
        for key, _, fmt in columns:
            value = row.get(key)
            if value is None:
                line.append("")
            elif key in PERCENT and row.get("objectives", 1) != 1:
                line.append(f"{value:.3f}")
            else:
                line.append(fmt.format(value * 100 if key in PERCENT else value))
        cells.append(line)
    return cells


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A plain-text table; EM, F1 and ACC in percent as in the paper."""
    cells = table_cells(rows)
    widths = [max(len(r[i]) for r in cells) for i in range(len(cells[0]))]
    lines = []
    for n, line in enumerate(cells):
        lines.append(
            "  ".join(
                c.ljust(w) if i < LEFT_ALIGNED else c.rjust(w)
                for i, (c, w) in enumerate(zip(line, widths, strict=True))
            ).rstrip()
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise MemSearcherError("plots need matplotlib: pip install 'memsearcher[eval]'") from None
    return plt


def draw_token_plots(rows: Sequence[dict[str, Any]], folder: str | Path) -> list[Path]:
    """One PNG per dataset: mean prompt tokens at each turn, one line per run.

    A flat line is MemSearcher's compact memory; a rising one is ReAct's growing history.
    """
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    by_dataset: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("prompt_tokens_by_turn"):
            by_dataset.setdefault(row["dataset"], []).append(row)
    paths = []
    for name in sorted(by_dataset, key=dataset_order):
        figure, axes = plt.subplots(figsize=(6, 4))
        for row in by_dataset[name]:
            values = row["prompt_tokens_by_turn"]
            axes.plot(range(1, len(values) + 1), values, marker="o", label=row["run"])
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.set_ylim(bottom=0)  # from zero: a flat line and a rising one compare honestly
        axes.set_xlabel("turn")
        axes.set_ylabel("prompt tokens (mean)")
        axes.set_title(f"{name}: context size per turn")
        axes.grid(alpha=0.3)
        axes.legend()
        path = folder / f"tokens_per_turn_{name}.png"
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        plt.close(figure)
        paths.append(path)
    return paths


def objective_points(
    rows: Sequence[dict[str, Any]], key: str
) -> dict[str, list[tuple[float, float]]]:
    """Per agent, (N, mean of ``key``) over its rows at each number of objectives N.

    Rows of several runs or datasets of one agent at the same N are averaged; "avg" rows are
    left out (they repeat their run's datasets).
    """
    values: dict[str, dict[float, list[float]]] = {}
    for row in rows:
        if row.get("dataset") == "avg" or row.get(key) is None:
            continue
        agent = row.get("agent") or row["run"]
        values.setdefault(agent, {}).setdefault(float(row["objectives"]), []).append(row[key])
    return {
        agent: [(n, sum(v) / len(v)) for n, v in sorted(by_n.items())]
        for agent, by_n in sorted(values.items())
    }


def draw_objective_plots(rows: Sequence[dict[str, Any]], folder: str | Path) -> list[Path]:
    """Peak tokens and EM against the number of objectives N, one line per agent (MEM1's
    Figure: a constant-memory agent stays flat while ReAct's context grows). Nothing is drawn
    unless the runs cover at least two values of N."""
    if len({row.get("objectives", 1) for row in rows if row.get("dataset") != "avg"}) < 2:
        return []
    plt = _pyplot()
    from matplotlib.ticker import ScalarFormatter

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, label in (("peak_tokens", "peak tokens (mean)"), ("em", "EM (summed over N)")):
        figure, axes = plt.subplots(figsize=(6, 4))
        ns: set[float] = set()
        for agent, points in objective_points(rows, key).items():
            axes.plot(*zip(*points, strict=True), marker="o", label=agent)
            ns.update(n for n, _ in points)
        axes.set_xscale("log", base=2)
        axes.set_xticks(sorted(ns))
        axes.xaxis.set_major_formatter(ScalarFormatter())
        axes.set_ylim(bottom=0)
        axes.set_xlabel("objectives per task (N)")
        axes.set_ylabel(label)
        axes.set_title(f"{label} against N")
        axes.grid(alpha=0.3)
        axes.legend()
        path = folder / f"{key}_by_objectives.png"
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        plt.close(figure)
        paths.append(path)
    return paths


def paired_differences(
    before: Sequence[dict[str, Any]], after: Sequence[dict[str, Any]], metric: str
) -> list[float]:
    """``metric`` after minus before, question by question: records are matched by id, a
    question only one run holds is left out, and a question saved twice counts by its last
    record (as `latest_records` reads a predictions file)."""
    scored = {r["id"]: r[metric] for r in before}
    latest = {r["id"]: r[metric] for r in after}
    return [value - scored[id_] for id_, value in latest.items() if id_ in scored]


def paired_bootstrap(differences: Sequence[float], resamples: int, seed: int = 0) -> dict[str, Any]:
    """The mean of ``differences`` and its 95% percentile-bootstrap interval: the questions are
    resampled with replacement ``resamples`` times (numpy's generator, ``seed``)."""
    values = np.asarray(differences, dtype=float)
    if values.size == 0:
        return {"questions": 0, "gain": None, "low": None, "high": None}
    rng = np.random.default_rng(seed)
    means = values[rng.integers(0, values.size, size=(resamples, values.size))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return {"questions": int(values.size), "gain": float(values.mean()), "low": float(low),
            "high": float(high)}  # fmt: skip
