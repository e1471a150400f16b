"""What only a GPU can show: the default precision trains, and the decoder behaves on CUDA.

Skipped without CUDA (CI has none); run on a lent GPU with ``pytest -m gpu tests/test_gpu.py``.
Results of the last run are in docs/training.md ("Verified on a GPU").
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_model import save_tiny_model

from memsearcher.llm.base import SamplingParams
from memsearcher.llm.hf import HFModel
from memsearcher.retrieval.bm25 import build_bm25
from memsearcher.rl.config import GRPOConfig, ModelConfig, load_config
from memsearcher.rl.policy import resolve_precision
from memsearcher.rl.rewards import REWARDS
from memsearcher.types import Trajectory

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_default_precision_on_cuda_is_float32_weights_under_bfloat16() -> None:
    precision = resolve_precision(ModelConfig(), "cuda")
    assert (precision.weights, precision.compute) == (torch.float32, "bfloat16")


def test_adamw_at_lr_1e6_on_cuda_moves_float32_master_weights_only() -> None:
    """A real layer, 100 AdamW steps at the paper's lr: bfloat16 weights stay put, float32
    weights under bfloat16 autocast move."""
    torch.manual_seed(0)
    moved = {}
    for dtype in (torch.bfloat16, torch.float32):
        layer = torch.nn.Linear(256, 256).cuda().to(dtype)
        start = layer.weight.detach().clone()
        optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-6, weight_decay=0.0)
        inputs = torch.randn(64, 256, device="cuda")
        for _ in range(100):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = layer(inputs.to(dtype)).float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        moved[dtype] = (layer.weight.detach() != start).float().mean().item()
    assert moved[torch.bfloat16] < 0.01  # essentially nothing moves
    assert moved[torch.float32] > 0.99


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"), hidden=128)


def test_batched_greedy_equals_one_by_one_on_cuda(tiny: Path) -> None:
    llm = HFModel.from_pretrained(str(tiny), device="cuda", dtype="float32")
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 2000, (n,), generator=generator).tolist() for n in (5, 17, 40)]
    params = SamplingParams(max_new_tokens=24)
    batched = llm.generate(prompts, params)
    assert batched == [llm.generate([p], params)[0] for p in prompts]
    sampled = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3)
    assert llm.generate(prompts, sampled) == llm.generate(prompts, sampled)


def test_grpo_trains_on_cuda_with_the_default_precision(tiny: Path, tmp_path: Path) -> None:
    """Two GRPO steps on the GPU with the defaults (float32 weights, bfloat16 autocast for
    rollouts, old/reference log-probs and the update): on-policy ratio 1, weights float32 and
    changed, KL finite."""

    def reward(trajectory: Trajectory) -> float:
        return float(len(trajectory.turns[0].action_text) % 5) / 5 if trajectory.turns else 0.0

    REWARDS["gpu-length"] = reward
    questions = tmp_path / "questions.jsonl"
    questions.write_text(
        "".join(
            json.dumps({"id": str(i), "question": f"Who is person {i}?", "golden_answers": ["X"]})
            + "\n"
            for i in range(8)
        )
    )
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"id": str(i), "contents": f'"Person {i}"\nPerson {i} lives in town {i}.'})
            + "\n"
            for i in range(8)
        )
    )
    build_bm25(corpus, tmp_path / "index")
    out = tmp_path / "out"
    config = load_config(
        GRPOConfig,
        None,
        [f"data={questions}", f"output_dir={out}", f"model.path={tiny}", "model.device=cuda",
         f"retriever={tmp_path / 'index'}", "steps=2",
         "questions_per_step=4", "mini_batch_questions=4", "group_size=4", "beta=0.01",
         "agent.max_new_tokens=24", "agent.memory_tokens=24", "agent.max_turns=2",
         "optim.lr=1e-4", "reward=gpu-length", "tensorboard=false", "sample_every=0"],
    )  # fmt: skip
    from memsearcher.rl.train_grpo import train_grpo

    train_grpo(config)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = metrics[0]
    assert first["train/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
    assert all(m["train/grad_norm"] > 0 and m["train/kl"] < 10 for m in metrics)
    start = load_file(tiny / "model.safetensors")
    end = load_file(out / "step-2" / "model" / "model.safetensors")
    assert all(v.dtype == torch.float32 for v in end.values())
    assert any(not torch.equal(start[k], end[k]) for k in end)
    print("gpu grpo metrics:", json.dumps(metrics))
