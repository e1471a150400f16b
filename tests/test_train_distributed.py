"""Two data-parallel GRPO ranks on CPU (gloo, launched by torchrun) end with equal weights.

Each rank rolls out its own shard of the step's questions, so the ranks' gradients differ;
DDP averages them, and both replicas must take the same optimizer step.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_model import save_tiny_model

HERE = Path(__file__).parent


@pytest.mark.slow
def test_two_gloo_ranks_end_with_identical_parameters(tmp_path: Path) -> None:
    tiny = save_tiny_model(tmp_path / "tiny")
    questions = tmp_path / "questions.jsonl"
    questions.write_text(
        "".join(
            json.dumps({"id": str(i), "question": f"Who is person {i}?", "golden_answers": ["X"]})
            + "\n"
            for i in range(8)
        )
    )
    out = tmp_path / "out"
    out.mkdir()
    overrides = [
        f"data={questions}",
        f"output_dir={out}",
        f"model.path={tiny}",
        "model.device=cpu",
        "steps=1",
        "questions_per_step=4",
        "mini_batch_questions=4",
        "group_size=3",
        "agent.max_new_tokens=12",
        "agent.memory_tokens=12",
        "agent.max_turns=2",
        "optim.lr=1e-3",
        "micro_batch_tokens=1600",
        "reward=test-length",
        "tensorboard=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node=2", str(HERE / "ddp_worker.py"), str(out), *overrides]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]

    rank0, rank1 = (load_file(out / f"rank{r}.safetensors") for r in (0, 1))
    start = load_file(tiny / "model.safetensors")
    assert rank0.keys() == rank1.keys()
    for key in rank0:
        torch.testing.assert_close(rank0[key], rank1[key], rtol=0, atol=0, msg=key)
    assert any(not torch.equal(rank0[k], v) for k, v in start.items() if k in rank0)
    assert (out / "step-1" / "state.json").is_file()
    assert (out / "step-1" / "rng-rank1.pt").is_file()  # each rank saves its own RNG
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1  # rank 0 alone logs
