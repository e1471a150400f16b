"""benchmarks/gpu_rung.py at the tiny shape on the CPU, so the GPU rung's script cannot rot
between the times a GPU is lent: the trainer's steps run, and every figure is in the JSON with a
sane value (CPU: peak memory n/a; MFU only against a peak given by flag)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "gpu_rung.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_rung", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_gpu_rung_runs_at_the_tiny_shape_and_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "rung.json"
    argv = ["--shape", "tiny", "--device", "cpu", "--steps", "3", "--batch", "1", "--group",
            "2", "--max-new-tokens", "16", "--repeats", "1", "--peak-tflops", "1",
            "--out", str(out)]  # fmt: skip
    load_script().main(argv)
    figures = json.loads(out.read_text())

    assert figures["shape"] == "tiny" and figures["dtype"] == "float32"
    assert figures["model"]["parameters"] > 0
    decoder = figures["decoder"]
    assert decoder["prompts"] == 2  # one step's first actions: 1 question x G=2
    for key in ("ours_tokens_per_s", "transformers_tokens_per_s", "ours_over_transformers"):
        assert math.isfinite(decoder[key]) and decoder[key] > 0, key
    trainer = figures["trainer"]
    assert trainer["steps"] == 3  # three whole steps of train_grpo
    for key in ("step_seconds", "rollout_tokens_per_s", "update_padded_tokens_per_s"):
        assert len(trainer[key]) == 3 and all(v > 0 for v in trainer[key]), key
    learner = figures["learner"]
    assert learner["turns"] > learner["trajectories"] == 2  # protocol trajectories, multi-turn
    assert learner["per_turn_tokens_per_s"] > 0 and learner["packed_tokens_per_s"] > 0
    # packing computes each trajectory's shared prompt once: fewer tokens processed
    assert learner["packed_processed_tokens"] < learner["per_turn_processed_tokens"]
    assert figures["peak_memory_gib"] is None  # n/a on a CPU
    assert figures["peak_tflops"] == 1.0
    assert set(figures["mfu"]) == {"update", "per_turn", "packed"}
    assert all(0 < v < 1 for v in figures["mfu"].values())  # a CPU is far below 1 TFLOPS


def test_the_real_shapes_are_qwen25s() -> None:
    """The published config.json values of Qwen2.5-1.5B and -3B (tied embeddings, set for
    every shape by the script)."""
    shapes = load_script().SHAPES
    assert shapes["1.5b"] == dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                  num_attention_heads=12, num_key_value_heads=2,
                                  vocab_size=151936)  # fmt: skip
    assert shapes["3b"] == dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                                num_attention_heads=16, num_key_value_heads=2,
                                vocab_size=151936)  # fmt: skip
