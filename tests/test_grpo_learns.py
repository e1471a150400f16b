"""GRPO must raise mean reward on a task where reward is easy to measure.

Setup, with the real agent loop, the real embedded BM25 retriever and the real trainers:

- a tiny Llama (random init, SmolLM2 tokenizer) is warm-started by SFT on protocol-perfect
  MemSearcher trajectories (search once, write a fixed memory, answer); for every question one
  in four of them answers "Paris" (gold) and three "London" (`SFT_ANSWERS`), so after SFT the
  policy writes the protocol well but mostly picks the wrong answer: graded reward about
  0.1 + 0.9 / 4;
- GRPO then trains on the same questions with the graded reward (1.0 for Paris, 0.1 for a
  well-formed London, 0 for a malformed trajectory).

The only way up is to learn which answer is rewarded, which is what GRPO's group-relative
advantage teaches. Rollouts sample at temperature 0.7 (log-probs use the same temperature, so
the update stays on-policy): at 1.0 the tiny model's long vocabulary tail breaks about one
trajectory in five and drowns the signal in format failures.

Why the margin holds: a step's mean over 32 trajectories with reward std about 0.45 has a
standard error of about 0.08, so the difference between the mean of the last 3 steps and of the
first 2 has one of about 0.075 when nothing is learned; 0.2 is over 2.5 of those. A start near
0.3 leaves room to rise by far more than 0.2, which the old even split (start near 0.55) did
not: on another machine GAE's margin fell to 0.16 (issue 33).

Measured over seeds 0-4 (`python benchmarks/learning_margins.py tests/test_grpo_learns.py`;
a seed stands in for another machine), margin last 3 - first 2 (bound 0.2):

| seed | 0 | 1 | 2 | 3 | 4 |
| --- | --- | --- | --- | --- | --- |
| gae | 0.584 | 0.539 | 0.347 | 0.608 | 0.614 |
| grpo | 0.614 | 0.548 | 0.254 | 0.600 | 0.571 |

(8 steps with the even split gave 0.21-0.32 here.) About 3-7 s per step on 2 cores.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from _policies import search_once_then_answer
from tiny_model import save_tiny_model

from memsearcher.agent import AgentConfig, Templates, run_lockstep, start_episodes
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.hf import HFTokenizer
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval.base import Retriever
from memsearcher.rl.config import GRPOConfig, SFTConfig, load_config
from memsearcher.rl.train_grpo import train_grpo
from memsearcher.rl.train_sft import train_sft
from memsearcher.types import QAExample

TEMPLATES = {
    "memsearcher_system": "Search, then answer in a box.",
    "memsearcher_tool_response": (
        "<tool_response>\n{passages}\n</tool_response>\nUpdate your memory."
    ),
}
PLACES = [
    "France",
    "Europe",
    "Seine",
    "Louvre",
    "Eiffel Tower",
    "Notre-Dame",
    "Versailles",
    "Montmartre",
]
AGENT = ["agent.max_turns=2", "agent.memory_tokens=16", "agent.max_new_tokens=48", "agent.top_n=1"]
SFT_STEPS = 100
SFT_ANSWERS = ("Paris", "London", "London", "London")
"""One teacher trajectory in four answers the gold: after SFT, reward starts near 0.1 + 0.9 / 4."""
GRPO_STEPS = 12


ESTIMATORS = {
    "grpo": [],
    # PPO with a critic (MEM1's algorithm): per-token GAE advantages against a value model
    # that starts from the SFT model with a fresh head and learns at the policy's lr
    "gae": ["advantage=gae", "critic.lr=1e-3", "entropy_coef=0.001"],
}


@pytest.mark.slow
@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_rl_raises_mean_reward(
    tmp_path: Path,
    retriever: Retriever,
    estimator: str,
    learning_seed: int,
    record_property: Callable[[str, object], None],
) -> None:
    from transformers import AutoTokenizer

    tiny = save_tiny_model(tmp_path / "tiny", seed=learning_seed)
    templates_file = tmp_path / "templates.yaml"
    templates_file.write_text(yaml.safe_dump(TEMPLATES))
    tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(tiny))
    questions = [
        QAExample(f"q{i}", f"Which city has the {p}?", ("Paris",)) for i, p in enumerate(PLACES)
    ]
    questions_file = tmp_path / "questions.jsonl"
    questions_file.write_text(
        "".join(
            json.dumps({"id": q.id, "question": q.question, "golden_answers": ["Paris"]}) + "\n"
            for q in questions
        )
    )

    config = AgentConfig(max_turns=2, memory_tokens=16, max_new_tokens=48, top_n=1)
    trajectories = []
    for answer in SFT_ANSWERS:
        episodes = start_episodes(
            "memsearcher", questions, tokenizer, config, Templates(**TEMPLATES)
        )
        llm = ScriptedLLM(tokenizer, search_once_then_answer(answer))
        trajectories += run_lockstep(episodes, llm, retriever, SamplingParams())
    assert all(t.well_formed and len(t.sequences) == 2 for t in trajectories)
    sft_data = tmp_path / "sft.jsonl"
    sft_data.write_text("".join(json.dumps(t.to_dict()) + "\n" for t in trajectories))

    sft = load_config(
        SFTConfig,
        None,
        [f"data={sft_data}", f"output_dir={tmp_path / 'sft'}", f"model.path={tiny}",
         "model.device=cpu", f"steps={SFT_STEPS}", "sequences_per_step=16", "optim.lr=5e-3",
         f"save_every={SFT_STEPS}", "tensorboard=false", f"seed={learning_seed}"],
    )  # fmt: skip
    train_sft(sft)

    grpo = load_config(
        GRPOConfig,
        None,
        [f"data={questions_file}", f"output_dir={tmp_path / 'grpo'}",
         f"model.path={tmp_path / 'sft' / f'step-{SFT_STEPS}' / 'model'}", "model.device=cpu",
         f"templates={templates_file}", f"steps={GRPO_STEPS}", "questions_per_step=8",
         "mini_batch_questions=8", "group_size=4", "temperature=0.7", "optim.lr=1e-3",
         "beta=0", "tensorboard=false", "sample_every=0", f"save_every={GRPO_STEPS}", *AGENT,
         f"seed={learning_seed}",
         *ESTIMATORS[estimator]],
    )  # fmt: skip
    train_grpo(grpo)

    metrics = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").open()]
    rewards = [m["reward/mean"] for m in metrics]
    assert len(rewards) == GRPO_STEPS
    first, last = sum(rewards[:2]) / 2, sum(rewards[-3:]) / 3
    record_property("margin", round(last - first, 4))
    record_property("rewards", [round(r, 3) for r in rewards])
    assert last - first > 0.2, rewards
    assert metrics[-1]["reward/em"] > metrics[0]["reward/em"]
