"""Two data-parallel ranks on CPU (gloo), launched by torchrun or by `accelerate launch`.

Each rank rolls out its own shard of the step's questions, so the ranks' gradients differ;
DDP averages them, FSDP reduce-scatters them into shards, and either way both ranks must take
the same optimizer step. FSDP here is FSDP2 (``fully_shard``) on CPU with gloo, the same code
path as on GPUs with NCCL; GPUs themselves are not tested here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_model import save_tiny_model

from memsearcher.retrieval.base import Retriever

HERE = Path(__file__).parent
ROOT = HERE.parent


def write_questions(folder: Path) -> Path:
    questions = folder / "questions.jsonl"
    questions.write_text(
        "".join(
            json.dumps({"id": str(i), "question": f"Who is person {i}?", "golden_answers": ["X"]})
            + "\n"
            for i in range(8)
        )
    )
    return questions


def grpo_overrides(tiny: Path, questions: Path, out: Path) -> list[str]:
    return [
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


def run(command: list[str]) -> None:
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


def torchrun(out: Path, *args: str) -> None:
    """`ddp_worker.py` on two ranks; each dumps its final weights to ``out/rank{r}``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    run([*command, "--nproc_per_node=2", str(HERE / "ddp_worker.py"), str(out), *args])


def read_metrics(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_ranks_equal(out: Path) -> dict[str, torch.Tensor]:
    rank0, rank1 = (load_file(out / f"rank{r}.safetensors") for r in (0, 1))
    assert rank0.keys() == rank1.keys()
    for key in rank0:
        torch.testing.assert_close(rank0[key], rank1[key], rtol=0, atol=0, msg=key)
    return rank0


@pytest.mark.slow
def test_two_gloo_ranks_end_with_identical_parameters(tmp_path: Path) -> None:
    tiny = save_tiny_model(tmp_path / "tiny")
    out = tmp_path / "out"
    out.mkdir()
    torchrun(out, *grpo_overrides(tiny, write_questions(tmp_path), out))

    rank0 = assert_ranks_equal(out)
    start = load_file(tiny / "model.safetensors")
    assert any(not torch.equal(rank0[k], v) for k, v in start.items() if k in rank0)
    assert (out / "step-1" / "state.json").is_file()
    assert (out / "step-1" / "rng-rank1.json").is_file()  # each rank saves its own RNG
    metrics = read_metrics(out)
    assert len(metrics) == 1  # rank 0 alone logs


@pytest.mark.slow
def test_fsdp_matches_ddp_and_resumes_exactly(tmp_path: Path) -> None:
    """GRPO under FSDP2: rollouts and log-prob recomputation (uneven per rank) on gathered
    weights, a frozen reference for the KL, clipping by the global gradient norm, a whole-model
    checkpoint gathered onto rank 0, and a resume from step 1 that ends where the uninterrupted
    two steps did. Two steps of FSDP and of DDP end with the same weights."""
    tiny = save_tiny_model(tmp_path / "tiny")
    questions = write_questions(tmp_path)
    runs = {}
    for kind in ("ddp", "fsdp"):
        out = tmp_path / kind
        out.mkdir()
        overrides = grpo_overrides(tiny, questions, out)
        overrides += ["steps=2", "save_every=1", "beta=0.01", "optim.max_grad_norm=0.5"]
        torchrun(out, *overrides, f"model.distributed={kind}")
        runs[kind] = assert_ranks_equal(out)
    full, out = runs["fsdp"], tmp_path / "fsdp"
    for key, value in runs["ddp"].items():  # equal up to the order of float reductions
        torch.testing.assert_close(full[key], value, rtol=0, atol=1e-5, msg=key)
    norms = {k: [m["train/grad_norm"] for m in read_metrics(tmp_path / k)] for k in runs}
    assert norms["fsdp"] == pytest.approx(norms["ddp"], rel=1e-4)
    assert min(norms["fsdp"]) > 0.5  # clipping was active
    start = load_file(tiny / "model.safetensors")
    # every tensor moves: the root's own weights (embeddings, final norm) are trained too
    assert all(not torch.equal(full[k], v) for k, v in start.items())
    saved = load_file(out / "step-2" / "model" / "model.safetensors")
    for key, value in saved.items():  # the checkpoint is the whole model, not a shard
        torch.testing.assert_close(value, full[key], rtol=0, atol=0, msg=key)
    optimizer = torch.load(out / "step-2" / "optimizer.pt", weights_only=True)
    assert set(optimizer["state"]) == set(start)  # whole optimizer state, keyed by name

    shutil.rmtree(out / "step-2")
    overrides = grpo_overrides(tiny, questions, out)
    overrides += ["steps=2", "save_every=1", "beta=0.01", "optim.max_grad_norm=0.5"]
    torchrun(out, "--resume", *overrides, "model.distributed=fsdp")
    resumed = assert_ranks_equal(out)
    for key, value in full.items():
        torch.testing.assert_close(resumed[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", ["token-mean", "trajectory-mean"])
def test_uneven_ranks_train_on_the_loss_of_the_whole_mini_batch(
    tmp_path: Path, aggregation: str
) -> None:
    """Two DDP ranks, one holding a single short sequence and the other five, end with the
    gradient of the policy loss over all six in one process: each micro-batch is weighted by
    its share of the units of the whole mini-batch over all ranks, not of its own rank's."""
    from accumulate_worker import ADVANTAGES, TRAJECTORY_IDS, inputs
    from transformers import AutoModelForCausalLM

    from memsearcher.rl.batching import collate, right_aligned, sequence_logprobs
    from memsearcher.rl.loss import policy_loss

    tiny = save_tiny_model(tmp_path / "tiny")
    out = tmp_path / "grads.safetensors"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    run([*command, str(HERE / "accumulate_worker.py"), str(tiny), str(out), aggregation])

    model = AutoModelForCausalLM.from_pretrained(tiny)
    sequences, old, ref = inputs()
    whole = collate(sequences, range(6), pad_id=0)
    loss, _ = policy_loss(
        sequence_logprobs(model, whole), right_aligned(old, whole), ADVANTAGES,
        whole.loss_mask, 0.2, 0.3, ref_logprobs=right_aligned(ref, whole), beta=0.1,
        aggregation=aggregation, trajectory_ids=TRAJECTORY_IDS,
    )  # fmt: skip
    loss.backward()
    ranks = load_file(out)
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None
        torch.testing.assert_close(ranks[name], parameter.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory: pytest.TempPathFactory, retriever: Retriever) -> Path:
    """Protocol-perfect trajectories from the replay policy: sequences of ~1060 and ~420
    tokens, so ranks pack different numbers of micro-batches (see the FSDP check below)."""
    from transformers import AutoTokenizer

    from memsearcher.agent import AgentConfig, run_lockstep, start_episodes
    from memsearcher.agent.replay import search_then_answer
    from memsearcher.llm.base import SamplingParams
    from memsearcher.llm.hf import HFTokenizer
    from memsearcher.llm.scripted import ScriptedLLM
    from memsearcher.types import QAExample

    folder = tmp_path_factory.mktemp("sft")
    tiny = save_tiny_model(folder / "tiny")
    tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(tiny))
    examples = [QAExample(str(i), f"Who founded city {i}?", ("Romulus",)) for i in range(3)]
    llm = ScriptedLLM(tokenizer, search_then_answer(1, "Romulus", memory_words=10))
    config = AgentConfig(max_turns=3, memory_tokens=64, max_new_tokens=64)
    trajectories = run_lockstep(
        start_episodes("memsearcher", examples, tokenizer, config), llm, retriever, SamplingParams()
    )
    path = folder / "trajectories.jsonl"
    path.write_text("".join(json.dumps(t.to_dict()) + "\n" for t in trajectories))
    return path


SFT = ["steps=2", "sequences_per_step=4", "micro_batch_tokens=1100", "seed=1"]


def micro_batch_counts(data: Path, step: int) -> tuple[int, int]:
    """How many micro-batches each of two ranks packs at ``step`` of the `SFT` settings."""
    from memsearcher.rl.batching import plan_micro_batches
    from memsearcher.rl.seeding import draw
    from memsearcher.rl.train_sft import read_trajectories

    sequences = [s for t in read_trajectories(data) for s in t.sequences]
    chosen = draw(len(sequences), (step - 1) * 4, 4, seed=1)
    lengths = [len(s.input_ids) for s in sequences]
    rank0, rank1 = (plan_micro_batches(lengths, 1100, [[i] for i in chosen[r::2]]) for r in (0, 1))
    return len(rank0), len(rank1)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "extra"), [("ddp", []), ("fsdp", ["model.distributed=fsdp", "model.lora_rank=4"])]
)
def test_accelerate_launch_runs_sft_on_two_cpu_ranks(
    kind: str, extra: list[str], sft_data: Path, tmp_path: Path
) -> None:
    """`accelerate launch` with the shipped 8-GPU config, on 2 CPU processes: with no CUDA,
    accelerate still starts the ranks through torchrun and memsearcher falls back to gloo."""
    if kind == "fsdp":  # FSDP must survive ranks running different numbers of passes
        assert any(len(set(micro_batch_counts(sft_data, s))) == 2 for s in (1, 2))
    tiny = sft_data.parent / "tiny"
    out = tmp_path / "out"
    config = ROOT / "configs" / "accelerate" / f"{kind}-8gpu.yaml"
    command = ["accelerate", "launch", "--config_file", str(config), "--num_processes", "2"]
    command += [
        "-m",
        "memsearcher.cli",
        "train",
        "sft",
        "--config",
        str(ROOT / "configs" / "sft-tiny-cpu.yaml"),
    ]
    command += [f"data={sft_data}", f"output_dir={out}", f"model.path={tiny}", "tensorboard=false"]
    command += ["optim.lr=1e-3", "optim.warmup_steps=0", *SFT, *extra]
    run([str(Path(sys.executable).parent / command[0]), *command[1:]])

    step = out / "step-2"
    assert (step / "state.json").is_file()
    assert json.loads((step / "state.json").read_text())["world_size"] == 2
    assert {p.name for p in step.glob("rng-rank*")} == {"rng-rank0.json", "rng-rank1.json"}
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2]  # rank 0 alone logs
    start = load_file(tiny / "model.safetensors")
    if kind == "ddp":
        saved = load_file(step / "model" / "model.safetensors")
        assert any(not torch.equal(saved[k], start[k]) for k in saved)
    else:
        adapter = load_file(step / "model" / "adapter_model.safetensors")
        assert any("lora_B" in k and bool(v.abs().sum() > 0) for k, v in adapter.items())


@pytest.mark.slow
def test_sft_on_two_ranks_takes_the_gradient_of_the_whole_step(
    sft_data: Path, tmp_path: Path
) -> None:
    """Two DDP ranks holding different numbers of loss tokens take the step one process takes
    on all four sequences: each token weighs 1 / (tokens over all ranks), not 1 / (its own
    rank's), so the gradient norms and the mean NLL agree."""
    from memsearcher.rl.seeding import draw
    from memsearcher.rl.train_sft import read_trajectories

    sequences = [s for t in read_trajectories(sft_data) for s in t.sequences]
    chosen = draw(len(sequences), 0, 4, seed=1)
    tokens = [sum(sum(sequences[i].loss_mask) for i in chosen[r::2]) for r in (0, 1)]
    assert tokens[0] != tokens[1]  # else the two weightings agree
    tiny = sft_data.parent / "tiny"
    train = ["-m", "memsearcher.cli", "train", "sft", "--config"]
    train += [str(ROOT / "configs" / "sft-tiny-cpu.yaml")]
    settings = [f"data={sft_data}", f"model.path={tiny}", "tensorboard=false", "optim.lr=1e-3"]
    settings += ["optim.warmup_steps=0", "optim.max_grad_norm=0", *SFT]
    runs = {}
    for ranks in (1, 2):
        out = tmp_path / f"ranks{ranks}"
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
        launch = launch if ranks == 2 else []
        run([sys.executable, *launch, *train, f"output_dir={out}", *settings])
        runs[ranks] = read_metrics(out)
    for key in ("train/grad_norm", "train/loss"):
        one, two = ([m[key] for m in runs[r]] for r in (1, 2))
        assert two == pytest.approx(one, rel=1e-4), key


def test_unknown_strategy_and_an_ignored_accelerate_fsdp_config_are_clear_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from memsearcher.errors import MemSearcherError
    from memsearcher.rl.distributed import Runtime, wrap_for_training

    single = Runtime(rank=0, world_size=1, device=torch.device("cpu"))
    model = torch.nn.Linear(2, 2)
    with pytest.raises(MemSearcherError, match=r"\['ddp', 'fsdp'\]"):
        wrap_for_training(model, single, "zero3")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(MemSearcherError, match="model.distributed=fsdp"):
        wrap_for_training(model, single, "ddp")
    assert wrap_for_training(model, single, "fsdp") is model  # one process: nothing to shard
