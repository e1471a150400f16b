"""The demo's report: a markdown file with the results table and three PNG plots, and beside
it ``report.html``, the eval report's page over the demo's runs (a question browser)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memsearcher.errors import MemSearcherError

__all__ = [
    "format_behaviour",
    "format_chains",
    "format_copy_probe",
    "format_grpo_questions",
    "format_results",
    "format_teacher",
    "write_html_report",
    "write_report",
]

METHODS = ("untrained", "sft", "sft+grpo")


def format_results(results: dict[str, Any]) -> str:
    """The results table as markdown: one row per (method, agent)."""
    lines = [
        "| method | agent | EM | F1 | EM 1-hop | EM 2-hop | EM 3-hop | turns | format failures "
        "| prompt tokens, turn 1 -> last |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, s in results["evaluations"].items():
        method, agent = key.split("/")
        by_turn = s.get("prompt_tokens_by_turn") or [0.0]
        hops = s.get("em_by_hops", {})
        lines.append(
            f"| {method} | {agent} | {s['em']:.3f} | {s['f1']:.3f} | "
            + " | ".join(f"{hops[h]:.2f}" if h in hops else "-" for h in ("1", "2", "3"))
            + f" | {s['mean_turns']:.2f} | {s['format_failure_rate']:.2f} | "
            f"{by_turn[0]:.0f} -> {by_turn[-1]:.0f} |"
        )
    return "\n".join(lines)


def format_grpo_questions(results: dict[str, Any]) -> str:
    """EM of the SFT and SFT+GRPO models on GRPO's own questions next to the test questions.

    GRPO's questions are held out from SFT like the test ones; the gap between the two columns
    of gains is how much of what GRPO learned carries over to questions it never trained on.
    """
    lines = [
        "| agent | EM on GRPO's questions: SFT -> SFT+GRPO | EM on test: SFT -> SFT+GRPO |",
        "|---|---|---|",
    ]
    own, test = results["grpo_questions"], results["evaluations"]
    for agent in sorted({key.split("/")[1] for key in own}):
        cells = [
            f"{s[f'sft/{agent}']['em']:.3f} -> {s[f'sft+grpo/{agent}']['em']:.3f} "
            f"({s[f'sft+grpo/{agent}']['em'] - s[f'sft/{agent}']['em']:+.3f})"
            for s in (own, test)
        ]
        lines.append(f"| {agent} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def format_teacher(results: dict[str, Any]) -> str:
    """The SFT teacher's flaw settings and what its trajectories measure."""
    teacher = results["teacher"]
    rate = teacher["flaws"]["early_answer"]
    measured = ", ".join(
        f"{agent}: EM {t['em']:.3f}, early answers {t['early_answers']:.3f}"
        for agent, t in teacher.items()
        if agent not in ("flaws", "worlds")
    )
    return (
        f"SFT teacher: the oracle with a flaw; at each turn where a chain is read in part, it "
        f"answers with the last entity read instead of searching on, with probability {rate}. "
        f"On the train questions of {teacher['worlds']} renamed copies of the world: {measured}."
    )


def format_copy_probe(results: dict[str, Any]) -> str:
    """Teacher-forced accuracy on the name tokens of the ideal test trajectories."""
    probe = results["copy_probe"]
    return (
        f"Copy probe (top-token accuracy on the {probe['name_tokens']} name tokens of the ideal "
        f"agent's test trajectories, teacher-forced): {probe['warm-up']:.3f} after the copy "
        f"warm-up, {probe['sft']:.3f} after SFT."
    )


def format_behaviour(results: dict[str, Any]) -> str:
    """The behaviour metrics of the SFT and SFT+GRPO models, side by side."""
    from memsearcher.demo.behaviour import BEHAVIOURS

    agents = sorted({key.split("/")[1] for key in results["evaluations"]})
    lines = ["| behaviour | " + " | ".join(agents) + " |", "|---" * (len(agents) + 1) + "|"]
    for key, meaning in BEHAVIOURS.items():
        cells = []
        for agent in agents:
            before = results["evaluations"][f"sft/{agent}"]["behaviour"][key]
            after = results["evaluations"][f"sft+grpo/{agent}"]["behaviour"][key]
            cells.append("-" if before is None else f"{before:.3f} -> {after:.3f}")
        lines.append(f"| {meaning} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_chains(results: dict[str, Any]) -> str:
    """Test EM by question chain, SFT -> SFT+GRPO per agent: which kinds of question GRPO
    taught, and which it did not (a chain the agents stop short on shows here, not in EM)."""
    test = results["evaluations"]
    agents = sorted({key.split("/")[1] for key in test})
    lines = [
        "| chain | questions | " + " | ".join(agents) + " |",
        "|---" * (len(agents) + 2) + "|",
    ]
    for chain, counts in test[f"sft/{agents[0]}"]["em_by_chain"].items():
        cells = [
            f"{test[f'sft/{a}']['em_by_chain'][chain]['em']:.2f} -> "
            f"{test[f'sft+grpo/{a}']['em_by_chain'][chain]['em']:.2f}"
            for a in agents
        ]
        lines.append(f"| {chain.replace('>', ' > ')} | {counts['questions']} | "
                     + " | ".join(cells) + " |")  # fmt: skip
    return "\n".join(lines)


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise MemSearcherError(
            "the demo's plots need matplotlib: pip install 'memsearcher[eval]'"
        ) from None
    return plt


def _reward_plot(out: Path, agents: list[str]) -> Path:
    plt = _plt()
    figure, axes = plt.subplots(figsize=(6, 4))
    for agent in agents:
        rows = [json.loads(line) for line in (out / f"grpo-{agent}" / "metrics.jsonl").open()]
        rows = [r for r in rows if "reward/mean" in r]
        axes.plot([r["step"] for r in rows], [r["reward/mean"] for r in rows], marker="o",
                  label=agent)  # fmt: skip
    labels = ("GRPO step", "mean reward of the step's rollouts", "Reward under multi-context GRPO")
    return _save(figure, axes, labels, out / "reward_per_step.png")


def _em_plot(out: Path, results: dict[str, Any], agents: list[str]) -> Path:
    plt = _plt()
    figure, axes = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(agents)
    for k, agent in enumerate(agents):
        values = [results["evaluations"].get(f"{m}/{agent}", {}).get("em", 0.0) for m in METHODS]
        axes.bar([i + k * width for i in range(len(METHODS))], values, width, label=agent)
    axes.set_xticks([i + width * (len(agents) - 1) / 2 for i in range(len(METHODS))], METHODS)
    axes.set_ylim(0, 1)
    labels = ("", "exact match, held-out questions", "EM by method")
    return _save(figure, axes, labels, out / "em_by_method.png")


def _tokens_plot(out: Path, results: dict[str, Any], agents: list[str]) -> Path:
    from matplotlib.ticker import MaxNLocator

    plt = _plt()
    figure, axes = plt.subplots(figsize=(6, 4))
    for agent in agents:
        values = results["evaluations"][f"sft+grpo/{agent}"].get("prompt_tokens_by_turn", [])
        axes.plot(range(1, len(values) + 1), values, marker="o", label=agent)
    axes.set_ylim(bottom=0)  # from zero: a flat line and a rising one compare honestly
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    labels = ("turn", "prompt tokens (mean)", "Context size per turn (SFT + GRPO models)")
    return _save(figure, axes, labels, out / "prompt_tokens_per_turn.png")


def _save(figure: Any, axes: Any, labels: tuple[str, str, str], path: Path) -> Path:
    """Label the axes (x, y, title), add grid and legend, write the PNG."""
    axes.set_xlabel(labels[0])
    axes.set_ylabel(labels[1])
    axes.set_title(labels[2])
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    _plt().close(figure)
    return path


def write_report(out: str | Path, results: dict[str, Any]) -> Path:
    """Write ``report.md`` and its plots into ``out``; return the report's path."""
    out = Path(out)
    agents = sorted({key.split("/")[1] for key in results["evaluations"]})
    plots = [
        _reward_plot(out, agents),
        _em_plot(out, results, agents),
        _tokens_plot(out, results, agents),
    ]
    world = results["world"]
    own_count = next(iter(results["grpo_questions"].values()))["questions"]
    timings = ", ".join(f"{name} {seconds} s" for name, seconds in results["timings"].items())
    text = [
        f"# memsearcher demo (seed {results['seed']})",
        "",
        f"World: {world['passages']} passages; {world['train']} SFT (train), {world['rl']} GRPO "
        f"(rl), {world['dev']} dev and {world['test']} test questions (1 to 3 hops; the rl, dev "
        "and test questions start from entities no train question starts from). SFT reads "
        "renamed copies of the train questions, GRPO a renamed copy of the rl ones.",
        "",
        format_teacher(results),
        "",
        format_copy_probe(results),
        "",
        f"Evaluated on {next(iter(results['evaluations'].values()))['questions']} held-out "
        "questions, greedy decoding.",
        "",
        format_results(results),
        "",
        f"The same models on GRPO's own {own_count} questions (the rl split of GRPO's renamed "
        "copy, with its index: held out from SFT, trained on by GRPO), next to the test "
        "questions:",
        "",
        format_grpo_questions(results),
        "",
        "What the agents did on the test questions (behaviour, SFT -> SFT + GRPO):",
        "",
        format_behaviour(results),
        "",
        "Test EM by question chain (the relations read, in order), SFT -> SFT + GRPO:",
        "",
        format_chains(results),
        "",
        *[f"![{p.stem}]({p.name})" for p in plots],
        "",
        f"Time: {timings}.",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(text), encoding="utf-8")
    write_html_report(out, results)
    return path


def write_html_report(out: str | Path, results: dict[str, Any]) -> Path:
    """``report.html`` beside ``report.md``: every evaluation run of the demo, one column each
    (untrained, SFT, SFT + GRPO; MemSearcher, then ReAct), so a test question shows what SFT and
    GRPO did with it, next to each other."""
    from memsearcher.eval.html import write_html
    from memsearcher.eval.report import load_rows

    out = Path(out)
    runs = [
        out / "eval" / f"{method}-{agent}"
        for method in METHODS
        for agent in ("memsearcher", "react")
        if f"{method}/{agent}" in results["evaluations"]
    ]
    return write_html(load_rows(runs), runs, out / "report.html")
