"""The shop demo's report: the results table of each decoding, RL's reward gain over SFT
paired by instruction, the teacher, RL's reward curves and the stage times
(``out/report.md``, which `memsearcher.demo.shop.run_shop_demo` writes the results for)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from memsearcher.agent.shop_agents import SHOP_AGENTS
from memsearcher.eval.predictions import latest_records, read_predictions
from memsearcher.eval.report import paired_bootstrap, paired_differences

__all__ = [
    "RL_SHOPS",
    "format_curve",
    "format_decoding",
    "format_shop_results",
    "reward_gain",
    "write_shop_report",
]

RL_SHOPS = {
    "fresh": "every instruction of one more shop of another seed, under the tested shop's ids",
    "tested": "the tested shop's rl instructions",
}
"""`memsearcher.demo.shop.ShopDemoConfig.rl_shop`'s choices, each with where RL shops."""


def format_curve(values: list[float]) -> str:
    """A reward curve as one line of two-decimal numbers."""
    return " ".join(f"{v:.2f}" for v in values)


def read_shop_predictions(
    out: Path, method: str, agent: str, folder: str = "eval"
) -> list[dict[str, Any]]:
    """The saved test predictions of one (method, agent) evaluation, one per instruction."""
    path = out / folder / f"{method}-{agent}" / "test" / "predictions.jsonl"
    return latest_records(read_predictions(path))


def reward_gain(
    out: Path, method: str, agent: str, folder: str = "eval", resamples: int = 10_000
) -> dict[str, Any]:
    """The RL run's reward minus SFT's, instruction by instruction, for ``agent`` (evaluated
    into ``out/folder``): the mean and its paired bootstrap 95% interval, over the
    instructions both evaluations hold."""
    before = read_shop_predictions(out, "sft", agent, folder)
    after = read_shop_predictions(out, method, agent, folder)
    return paired_bootstrap(paired_differences(before, after, "reward"), resamples)


def format_decoding(evaluations: dict[str, Any], gains: dict[str, Any]) -> str:
    """One decoding's results table, then each RL run's gain over SFT with its interval."""
    lines = [
        f"- {name}: {g['gain']:+.3f} [{g['low']:+.3f}, {g['high']:+.3f}] over {g['questions']}"
        if g["questions"]
        else f"- {name}: no instruction evaluated for both RL and SFT"
        for name, g in gains.items()
    ]
    return (
        format_shop_results(evaluations)
        + "\n\nRL minus SFT, mean reward, with its paired bootstrap 95% interval over the "
        + "instructions:\n"
        + "\n".join(lines)
    )


def format_shop_results(evaluations: dict[str, Any]) -> str:
    """The results table as markdown: one row per (method, agent), on the test instructions."""
    lines = [
        "| method | agent | mean reward | success | steps | peak tokens | episodes of 8+ steps: "
        "count, peak tokens | format failures |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, s in evaluations.items():
        method, agent = key.split("/")
        long = s["peak_prompt_tokens_long"]
        long_cell = f"{s['long_episodes']}, {long['mean']:.0f}" if long else "0, -"
        lines.append(
            f"| {method} | {agent} | {s['mean_reward']:.3f} | {s['success_rate']:.3f} | "
            f"{s['mean_steps']:.2f} | {s['peak_prompt_tokens']['mean']:.0f} | {long_cell} | "
            f"{s['format_failure_rate']:.2f} |"
        )
    return "\n".join(lines)


def write_shop_report(out: str | Path, results: dict[str, Any]) -> Path:
    """Write ``out/report.md``: the table, the teacher, RL's reward per step, stage times."""
    out = Path(out)
    teacher = results["teacher"]
    flaws = ", ".join(f"{k} {v}" for k, v in teacher["flaws"].items() if k != "seed")
    measured = "; ".join(
        f"{agent}: mean reward {teacher[agent]['mean_reward']:.3f}, success "
        f"{teacher[agent]['success_rate']:.3f}, steps {teacher[agent]['mean_steps']:.2f}"
        for agent in SHOP_AGENTS
    )
    curves = "\n".join(f"- {name}: {format_curve(r)}" for name, r in results["rl_rewards"].items())
    times = ", ".join(f"{name} {s:.0f} s" for name, s in results["timings"].items())
    probe = results["copy_probe"]
    where = RL_SHOPS[results["config"]["rl_shop"]]
    text = f"""# Shop demo, seed {results["seed"]}

Held-out test instructions of the tested shop ({results["shop"]}).

## Greedy decoding

{format_decoding(results["evaluations"], results["gains"])}

## Sampled at temperature {results["sampled"]["temperature"]} (the RL rollouts')

{format_decoding(results["sampled"]["evaluations"], results["sampled"]["gains"])}

## Training

Teacher (SFT data, {teacher["shops"]} shops of other seeds with the tested shop's ids):
flaws {flaws}. Measured on its trajectories: {measured}.

Copy probe (teacher-forced top-token accuracy on the {probe["id_tokens"]} product-id tokens
of the ideal shopper's held-out trajectories): untrained {probe["init"]:.3f}, after the copy
warm-up {probe["warm-up"]:.3f}, after SFT {probe["sft"]:.3f}.

RL mean reward per step (rollouts at temperature {results["config"]["temperature"]}, {where}):
{curves}

Stage times: {times}.
"""
    path = out / "report.md"
    path.write_text(text, encoding="utf-8")
    return path
