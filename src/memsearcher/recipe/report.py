"""The embedded agent's report: what SFT and GRPO did, read from the recipe's own files.

Every number comes from the saved predictions and metrics, so a reader can recompute it: EM,
F1, format failures, searches and prompt tokens per turn by run, dataset and number of hops;
the paired bootstrap interval of GRPO's gain over SFT; what GRPO changed in behaviour; the
teacher's flaw rates; stage times; the reward curve as a plot.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from memsearcher.eval.predictions import latest_records, prediction_record, read_predictions
from memsearcher.eval.report import paired_bootstrap, paired_differences
from memsearcher.types import Trajectory

__all__ = [
    "agent_gaps",
    "analyse",
    "format_agent_gaps",
    "format_rollouts",
    "rollouts",
    "write_report",
]

BEHAVIOURS = {
    "searches_per_hop": "searches per hop of the question's chain",
    "early_answers": "answers given after fewer searches than the chain has hops",
    "first_query_entity": "first query is exactly the question's entity",
    "memory_keeps_bridge": "two-hop, MemSearcher: memories after the first search that keep "
    "the bridge entity",
}
"""The behaviour metrics, by key, with what each counts."""


def analyse(out: Path, agents: Sequence[str], bootstrap: int) -> dict[str, Any]:
    """Per run and dataset: the metrics by number of hops and the behaviour; per agent: the
    paired bootstrap of SFT+GRPO minus SFT EM on each dataset and on both pooled; per stage:
    MemSearcher minus ReAct (`agent_gaps`)."""
    runs: dict[str, Any] = {}
    records: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for run in sorted((out / "eval").iterdir()):
        model, agent = run.name.split("-", 1)
        key = f"{model}/{agent}"
        # one record per question (a retried error is followed by its answer); errors apart
        records[key] = {
            folder.name: [r for r in latest_records(read_predictions(folder / "predictions.jsonl"))
                          if r["trajectory"] is not None]
            for folder in sorted(run.iterdir())
            if (folder / "predictions.jsonl").is_file()
        }  # fmt: skip
        runs[key] = {dataset: describe(rows) for dataset, rows in records[key].items()}
    gains: dict[str, Any] = {}
    for agent in agents:
        before, after = records.get(f"sft/{agent}"), records.get(f"grpo/{agent}")
        if not before or not after:
            continue
        pairs = {d: paired_differences(before[d], after[d], "em") for d in before if d in after}
        pairs["pooled"] = [p for d in list(pairs) for p in pairs[d]]
        gains[agent] = {d: paired_bootstrap(p, bootstrap) for d, p in pairs.items()}
    return {"runs": runs, "gains": gains, "agents": agent_gaps(records, bootstrap)}


def agent_gaps(
    records: dict[str, dict[str, list[dict[str, Any]]]], bootstrap: int
) -> dict[str, Any]:
    """Per stage evaluated as both agents (``sft``: the SFT model as either agent; ``grpo``:
    each agent's own GRPO model): MemSearcher minus ReAct EM, paired by question, with its
    bootstrap interval, on each dataset, on each number of hops where a dataset's questions
    differ in hops, and on the datasets pooled."""
    gaps: dict[str, Any] = {}
    for model in ("sft", "grpo"):
        ours, react = records.get(f"{model}/memsearcher"), records.get(f"{model}/react")
        if not ours or not react:
            continue
        pairs: dict[str, list[float]] = {}
        for dataset in (d for d in ours if d in react):
            pairs[dataset] = paired_differences(react[dataset], ours[dataset], "em")
            hops = {r["id"]: _chain(r)[1] for r in ours[dataset]}
            if len(set(hops.values())) < 2:
                continue
            for h in sorted(set(hops.values())):
                mine = [r for r in ours[dataset] if hops[r["id"]] == h]
                theirs = [r for r in react[dataset] if hops.get(r["id"]) == h]
                pairs[f"{dataset}, {h}-hop"] = paired_differences(theirs, mine, "em")
        pairs["pooled"] = [p for d in ours if d in react for p in pairs[d]]
        gaps[model] = {name: paired_bootstrap(p, bootstrap) for name, p in pairs.items()}
    return gaps


def describe(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """EM, F1, format failures, searches and prompt tokens of ``records``, all and by hops."""
    by_hops: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        by_hops.setdefault(str(_chain(record)[1]), []).append(record)
    return {
        **_metrics(records),
        "by_hops": {hops: _metrics(rows) for hops, rows in sorted(by_hops.items())},
        "behaviour": behaviour(records),
    }


def _metrics(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    n = max(len(records), 1)
    tokens = [t for r in records for t in r.get("prompt_tokens", [])]
    longest = max((len(r.get("prompt_tokens", [])) for r in records), default=0)
    by_turn = [
        float(np.mean([r["prompt_tokens"][k] for r in records if len(r["prompt_tokens"]) > k]))
        for k in range(longest)
    ]
    return {
        "questions": len(records),
        "em": sum(r["em"] for r in records) / n,
        "f1": sum(r["f1"] for r in records) / n,
        "format_failures": sum(r["end_reason"] in ("format_error", "length") for r in records) / n,
        "turn_limit": sum(r["end_reason"] == "max_turns" for r in records) / n,
        "searches_per_question": sum(r.get("searches", 0) for r in records) / n,
        "prompt_tokens_per_turn": float(np.mean(tokens)) if tokens else 0.0,
        "prompt_tokens_by_turn": by_turn,
    }


def _chain(record: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """The question's chain of facts and its number of hops; a synthetic world's question
    keeps its hops; a held-out question (only its passage's title is known) is one hop from
    that title's entity."""
    metadata = record["trajectory"]["example"]["metadata"]
    chain = metadata.get("chain")
    if chain:
        return chain, len(chain)
    hops = _world_hops(metadata)
    if hops is not None:
        return [{"entity": h["entity"], "answer": h["target"]} for h in hops], len(hops)
    entity = re.sub(r"\s*\(.*\)$", "", str(metadata.get("title", "")))
    return [{"entity": entity, "answer": None}], 1


def _world_hops(metadata: dict[str, Any]) -> list[dict[str, Any]] | None:
    """A synthetic world's question's hops (`memsearcher.data.synthetic.hops_of`'s rows); None
    for any other question (a Wikipedia one's ``hops`` is a count)."""
    hops = metadata.get("hops")
    return hops if isinstance(hops, list) else None


def behaviour(records: Iterable[dict[str, Any]]) -> dict[str, float | None]:
    """The `BEHAVIOURS` of ``records`` (None where no record counts)."""
    searches = hops = answered = early = first = questions = memories = kept = 0
    for record in records:
        chain, n = _chain(record)
        turns = record["trajectory"]["turns"]
        queries = [t["query"] for t in turns if t.get("query")]
        questions += 1
        hops += n
        searches += len(queries)
        first += bool(queries) and queries[0] == chain[0]["entity"]
        if record.get("prediction") is not None:
            answered += 1
            early += len(queries) < n
        if n == 2 and record["trajectory"]["agent"] == "memsearcher":
            for turn in turns:
                if turn.get("query") and turn.get("memory") is not None:
                    memories += 1
                    kept += chain[0]["answer"] in turn["memory"]
    return {
        "searches_per_hop": searches / hops if hops else None,
        "early_answers": early / answered if answered else None,
        "first_query_entity": first / questions if questions else None,
        "memory_keeps_bridge": kept / memories if memories else None,
    }


def rollouts(run: Path, block: int = 10) -> list[dict[str, Any]]:
    """GRPO's sampled trajectories (``run/samples/step-N.jsonl``) in blocks of ``block`` steps:
    for each block, the Wikipedia's questions and the synthetic worlds' apart, what `describe`
    says of evaluation records (EM, searches, by hops, behaviour)."""
    blocks: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for path in run.glob("samples/step-*.jsonl"):
        first = (int(path.stem.split("-")[1]) - 1) // block * block + 1
        for line in path.open(encoding="utf-8"):
            sample = json.loads(line)
            sample.pop("reward")  # the trainer's, written beside the trajectory's fields
            record = prediction_record("rollouts", Trajectory.from_dict(sample))
            world = _world_hops(record["trajectory"]["example"]["metadata"]) is not None
            blocks.setdefault((first, "worlds" if world else "wikipedia"), []).append(record)
    return [
        {"steps": f"{first}-{first + block - 1}", "source": source, **describe(records)}
        for (first, source), records in sorted(blocks.items())
    ]


# -- the report ---------------------------------------------------------------------------


def write_report(out: Path, results: dict[str, Any]) -> Path:
    """``out/report.md`` and ``out/reward_per_step.png`` from ``results``."""
    agents = results["config"]["agents"]
    analysis = results["analysis"]
    parts = [
        "# The embedded agent: SFT on an imperfect teacher, then multi-context GRPO\n",
        f"Machine: {results['machine']}. Questions: "
        + ", ".join(
            f"{n} {q['questions']} ({q['two_hop']} two-hop)"
            for n, q in results["questions"].items()
        )  # fmt: skip
        + "; held-out: the 58 handwritten questions.\n",
        "## Results\n",
        format_table(analysis["runs"]),
        "## GRPO minus SFT, paired bootstrap 95% interval over the questions\n",
        format_gains(analysis["gains"]),
        format_agent_gaps(analysis.get("agents"), "## "),
        "## Behaviour (test split)\n",
        format_behaviour(analysis["runs"], "test"),
        "## The teacher\n",
        format_teacher(results["data"]),
        "## Stage times (seconds)\n",
        "\n".join(f"- {name}: {seconds}" for name, seconds in results["timings"].items()) + "\n",
    ]
    for agent in agents:
        blocks = rollouts(out / f"grpo-{agent}")
        if blocks:
            parts += [f"## GRPO's rollouts ({agent}), by ten steps\n", format_rollouts(blocks)]
        selection = out / f"grpo-{agent}" / "selection.json"
        if selection.is_file():
            parts += [f"## The checkpoint kept ({agent})\n", format_selection(selection)]
    plot = _reward_plot(out, agents)
    if plot is not None:
        parts.append(f"![reward per step]({plot.name})\n")
    report = out / "report.md"
    report.write_text("\n".join(parts), encoding="utf-8")
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", "utf-8")
    return report


def format_table(runs: dict[str, Any]) -> str:
    lines = [
        "| model | agent | questions | hops | n | EM | F1 | format failures | turn limit "
        "| searches / q | prompt tokens / turn (turn 1 -> last) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, datasets in runs.items():
        model, agent = key.split("/")
        for dataset, summary in datasets.items():
            rows = [("all", summary), *summary["by_hops"].items()]
            for hops, m in rows:
                turns = m["prompt_tokens_by_turn"]
                span = f"{turns[0]:.0f} -> {turns[-1]:.0f}" if turns else ""
                lines.append(
                    f"| {model} | {agent} | {dataset} | {hops} | {m['questions']} "
                    f"| {m['em']:.3f} | {m['f1']:.3f} | {m['format_failures']:.1%} "
                    f"| {m['turn_limit']:.1%} | {m['searches_per_question']:.2f} "
                    f"| {m['prompt_tokens_per_turn']:.0f} ({span}) |"
                )
    return "\n".join(lines) + "\n"


def format_gains(gains: dict[str, Any], by: str = "agent", gain: str = "gain in EM") -> str:
    lines = [
        f"| {by} | questions | n | {gain} | 95% interval |",
        "| --- | --- | --- | --- | --- |",
    ]
    for agent, by_dataset in gains.items():
        for dataset, g in by_dataset.items():
            if g["gain"] is None:
                continue
            lines.append(f"| {agent} | {dataset} | {g['questions']} | {g['gain']:+.3f} "
                         f"| [{g['low']:+.3f}, {g['high']:+.3f}] |")  # fmt: skip
    return "\n".join(lines) + "\n"


def format_agent_gaps(gaps: dict[str, Any] | None, heading: str = "") -> str:
    """`agent_gaps`' table under its heading; nothing where one agent alone was evaluated."""
    if not gaps:
        return ""
    return (
        f"{heading}MemSearcher minus ReAct (SFT: one model as either agent; GRPO: each agent's "
        "own GRPO), paired bootstrap 95% interval over the questions\n\n"
        + format_gains(gaps, "stage", "MemSearcher - ReAct EM")
    )


def format_behaviour(runs: dict[str, Any], dataset: str) -> str:
    lines = ["| behaviour | " + " | ".join(runs) + " |", "| --- |" + " --- |" * len(runs)]
    for key, text in BEHAVIOURS.items():
        cells = []
        for datasets in runs.values():
            value = datasets.get(dataset, {}).get("behaviour", {}).get(key)
            cells.append("" if value is None else f"{value:.3f}")
        lines.append(f"| {text} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def format_rollouts(blocks: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| steps | questions | n | EM | format failures | searches / q | EM by hops (n) "
        "| early answers | first query = entity |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for b in blocks:
        hops = ", ".join(f"{h}: {m['em']:.2f} ({m['questions']})" for h, m in b["by_hops"].items())
        early, first = (_share(b["behaviour"][k]) for k in ("early_answers", "first_query_entity"))
        lines.append(
            f"| {b['steps']} | {b['source']} | {b['questions']} | {b['em']:.3f} "
            f"| {b['format_failures']:.1%} | {b['searches_per_question']:.2f} | {hops} "
            f"| {early} | {first} |"
        )
    return "\n".join(lines) + "\n"


def format_selection(selection: Path) -> str:
    """The greedy EM of each scored checkpoint on the selection questions, the kept one bold."""
    record = json.loads(selection.read_text("utf-8"))
    lines = [f"Greedy EM on {record['questions']} selection questions (synthetic worlds that "
             "neither SFT nor GRPO saw); the best step is kept.\n",
             "| step | EM |", "| --- | --- |"]  # fmt: skip
    for step, em in record["em"].items():
        mark = "**" if int(step) == record["chosen"] else ""
        lines.append(f"| {mark}{step}{mark} | {mark}{em:.3f}{mark} |")
    return "\n".join(lines) + "\n"


def _share(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def format_teacher(data: dict[str, Any]) -> str:
    stated, measured = data["flaws"]["stated"], data["flaws"]["measured"]
    return (
        f"{data['trajectories']} trajectories ({data['synthetic_trajectories']} synthetic, "
        f"{data['wiki_trajectories']} Wikipedia). Flaws, stated / measured on the Wikipedia "
        f"trajectories: first search for the answer's category {stated['category_query']} / "
        f"{measured['category_query']:.3f} (of {measured['trajectories']}); early answer after "
        f"the first hop of a two-hop question {stated['early_answer']} / "
        f"{measured['early_answer']:.3f} (of {measured['two_hop_trajectories']}).\n"
    )


def _reward_plot(out: Path, agents: Sequence[str]) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the eval extra is not installed: the report goes without its plot
        return None
    figure, axes = plt.subplots(figsize=(6, 3.5))
    for agent in agents:
        metrics = out / f"grpo-{agent}" / "metrics.jsonl"
        if not metrics.is_file():
            continue
        rows = [json.loads(line) for line in metrics.open(encoding="utf-8")]
        steps = [r["step"] for r in rows if "reward/mean" in r]
        axes.plot(steps, [r["reward/mean"] for r in rows if "reward/mean" in r], label=agent)
    axes.set_xlabel("GRPO step")
    axes.set_ylabel("mean reward of the step's rollouts")
    axes.legend()
    figure.tight_layout()
    path = out / "reward_per_step.png"
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
