"""GRPO and SFT end to end on CPU: two steps each, checkpoints, and an exact resume.

The policy is a tiny Llama built from a config with the embedded SmolLM2 tokenizer (see
`tiny_model.py`); the agent loop, the embedded BM25 retriever and the learner are the real ones.
An untrained model never answers, so every graded reward is 0 and every group degenerate;
the GRPO tests therefore register a reward that varies with the generated text (the length of
the first action, mod 5), which is enough to give non-zero advantages and real updates.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_model import save_tiny_model

from memsearcher.agent import AgentConfig, run_lockstep, start_episodes
from memsearcher.agent.replay import search_then_answer
from memsearcher.errors import MemSearcherError
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.hf import HFTokenizer
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval.base import Retriever
from memsearcher.rl.checkpoint import latest_checkpoint
from memsearcher.rl.config import GRPOConfig, SFTConfig, load_config
from memsearcher.rl.rewards import REWARDS
from memsearcher.rl.train_grpo import train_grpo
from memsearcher.rl.train_sft import train_sft
from memsearcher.types import QAExample, Trajectory


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def questions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "questions.jsonl"
    rows = [
        {"id": str(i), "question": f"Where was person {i} born?", "golden_answers": ["Paris"]}
        for i in range(8)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture
def length_reward(monkeypatch: pytest.MonkeyPatch) -> str:
    def reward(trajectory: Trajectory) -> float:
        return float(len(trajectory.turns[0].action_text) % 5) / 5 if trajectory.turns else 0.0

    monkeypatch.setitem(REWARDS, "test-length", reward)
    return "test-length"


def grpo_config(tiny: Path, questions: Path, out: Path, *overrides: str) -> GRPOConfig:
    return load_config(
        GRPOConfig,
        None,
        [
            f"data={questions}",
            f"output_dir={out}",
            f"model.path={tiny}",
            "model.device=cpu",
            "steps=2",
            "questions_per_step=4",
            "mini_batch_questions=2",
            "group_size=3",
            "agent.max_new_tokens=12",
            "agent.memory_tokens=12",
            "agent.max_turns=2",
            "optim.lr=1e-3",
            "micro_batch_tokens=1600",
            "beta=0.01",
            "save_every=1",
            "sample_every=1",
            *overrides,
        ],
    )


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(checkpoint / "model" / "model.safetensors")


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-6, atol=1e-7, msg=key)


def read_metrics(out: Path) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_grpo_two_steps_then_resume_from_step_one(
    tiny: Path, questions: Path, tmp_path: Path, length_reward: str
) -> None:
    full = tmp_path / "full"
    train_grpo(grpo_config(tiny, questions, full, f"reward={length_reward}"))
    assert latest_checkpoint(full) == full / "step-2"
    metrics = read_metrics(full)
    assert [m["step"] for m in metrics] == [1, 2]
    for key in ("reward/mean", "reward/std", "reward/em", "rollout/format_failure", "train/kl"):
        assert key in metrics[0]
    assert metrics[0]["train/grad_norm"] > 0
    samples = [json.loads(line) for line in (full / "samples" / "step-1.jsonl").open()]
    assert len(samples) == 4 * 3  # every trajectory of the step (4 questions, groups of 3)
    rewards = [sample["reward"] for sample in samples]
    assert sum(rewards) / len(rewards) == pytest.approx(metrics[0]["reward/mean"], abs=1e-6)
    assert any((full / "tensorboard").iterdir())
    start = weights_of_model(tiny)
    assert any(not torch.equal(start[k], v) for k, v in weights(full / "step-2").items())

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "step-1", resumed / "step-1")
    # as a run killed after logging step 2 but before saving it leaves the log
    shutil.copyfile(full / "metrics.jsonl", resumed / "metrics.jsonl")
    config = grpo_config(tiny, questions, resumed, f"reward={length_reward}")
    train_grpo(config, resume=True)
    assert [m["step"] for m in read_metrics(resumed)] == [1, 2]  # step 2 once, not twice
    assert_same_weights(full / "step-2", resumed / "step-2")
    state = json.loads((resumed / "step-2" / "state.json").read_text())
    assert state["step"] == 2
    assert not list(resumed.glob(".step-*"))  # no staging folder left behind


@pytest.mark.slow
def test_ppo_with_a_critic_two_steps_then_resume_from_step_one(
    tiny: Path, questions: Path, tmp_path: Path, length_reward: str
) -> None:
    """advantage=gae: the critic trains, is checkpointed beside the policy (first: the policy's
    step-N publishes the pair), and resumes with it exactly from the policy's step, whatever
    newer critic a killed save left; a critic checkpoint missing for the policy's step is
    refused."""
    ppo = [f"reward={length_reward}", "advantage=gae", "critic.kl_reward=0.01", "beta=0",
           "entropy_coef=0.01", "critic.lr=1e-3"]  # fmt: skip
    full = tmp_path / "full"
    train_grpo(grpo_config(tiny, questions, full, *ppo))
    metrics = read_metrics(full)
    for key in ("critic/vf_loss", "critic/grad_norm", "train/entropy", "reward/kl"):
        assert key in metrics[0], key
    assert metrics[0]["critic/grad_norm"] > 0 and metrics[0]["train/grad_norm"] > 0
    start = weights(full / "critic" / "step-1")
    assert any(not torch.equal(start[k], v) for k, v in weights(full / "critic" / "step-2").items())

    resumed = tmp_path / "resumed"
    shutil.copytree(full / "step-1", resumed / "step-1")
    with pytest.raises(MemSearcherError, match="no checkpoint in .*critic"):
        train_grpo(grpo_config(tiny, questions, resumed, *ppo), resume=True)
    shutil.copytree(full / "critic" / "step-1", resumed / "critic" / "step-1")
    train_grpo(grpo_config(tiny, questions, resumed, *ppo), resume=True)
    assert_same_weights(full / "step-2", resumed / "step-2")
    assert_same_weights(full / "critic" / "step-2", resumed / "critic" / "step-2")

    # killed after the critic's step-2 save, before the policy's: resumes from step 1 by itself
    killed = tmp_path / "killed"
    for part in ("step-1", "critic/step-1", "critic/step-2"):
        shutil.copytree(full / part, killed / part)
    train_grpo(grpo_config(tiny, questions, killed, *ppo), resume=True)
    assert_same_weights(full / "step-2", killed / "step-2")
    assert_same_weights(full / "critic" / "step-2", killed / "critic" / "step-2")


def weights_of_model(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


@pytest.mark.slow
def test_one_mini_batch_one_epoch_is_exactly_on_policy(
    tiny: Path, questions: Path, tmp_path: Path, length_reward: str
) -> None:
    """With one update per step the ratio is 1 and nothing is clipped: old log-probs are
    recomputed from the very weights being trained."""
    config = grpo_config(
        tiny,
        questions,
        tmp_path / "out",
        f"reward={length_reward}",
        "steps=1",
        "mini_batch_questions=4",
        "beta=0",
    )
    train_grpo(config)
    (metrics,) = read_metrics(tmp_path / "out")
    assert metrics["train/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["train/clip_fraction"] == 0.0
    assert "train/kl" not in metrics


@pytest.mark.slow
def test_the_shared_prefix_and_reused_logprobs_change_an_update_only_by_rounding(
    tiny: Path, questions: Path, tmp_path: Path, length_reward: str
) -> None:
    """The demo's learner settings (`share_prefix`, `reuse_logprobs` with one update a step)
    take the same step as computing every row whole and the old log-probs in a pass of their
    own: the same rollouts, loss terms and weights after the update, to float rounding."""
    runs = {}
    for name, levers in (("plain", "false"), ("levers", "true")):
        out = tmp_path / name
        config = grpo_config(
            tiny, questions, out, f"reward={length_reward}", "steps=1",
            "mini_batch_questions=4", f"share_prefix={levers}", f"reuse_logprobs={levers}",
        )  # fmt: skip
        train_grpo(config)
        (runs[name],) = read_metrics(out)
    plain, levers = runs["plain"], runs["levers"]
    assert levers["reward/mean"] == plain["reward/mean"]
    assert levers["rollout/sequences"] == plain["rollout/sequences"]
    for key in ("train/loss", "train/pg_loss", "train/kl", "train/ratio_mean"):
        assert levers[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key
    start, a, b = (weights_of_model(tiny), weights(tmp_path / "plain" / "step-1"),
                   weights(tmp_path / "levers" / "step-1"))  # fmt: skip
    assert any(not torch.equal(start[k], a[k]) for k in a)  # the update moved the weights
    # Adam's first step is about lr * sign(gradient): where a gradient is ~0, rounding can
    # flip its sign, so a handful of weights differ by far less than lr (1e-3)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=0, atol=1e-4, msg=key)
        assert ((b[key] - a[key]).abs() > 1e-6).float().mean() < 1e-3, key


@pytest.fixture(scope="module")
def replay_trajectories(
    tiny: Path, tmp_path_factory: pytest.TempPathFactory, retriever: Retriever
) -> Path:
    """Protocol-perfect trajectories from the replay policy, written as the agent writes them."""
    from transformers import AutoTokenizer

    tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(tiny))
    examples = [QAExample(str(i), f"Who founded city {i}?", ("Romulus",)) for i in range(6)]
    llm = ScriptedLLM(tokenizer, search_then_answer(1, "Romulus", memory_words=10))
    config = AgentConfig(max_turns=3, memory_tokens=64, max_new_tokens=64)
    episodes = start_episodes("memsearcher", examples, tokenizer, config)
    trajectories = run_lockstep(episodes, llm, retriever, SamplingParams())
    assert all(t.well_formed and len(t.sequences) == 2 for t in trajectories)
    path = tmp_path_factory.mktemp("sft") / "trajectories.jsonl"
    path.write_text("".join(json.dumps(t.to_dict()) + "\n" for t in trajectories))
    return path


def sft_config(tiny: Path, data: Path, out: Path, *overrides: str) -> SFTConfig:
    return load_config(
        SFTConfig,
        None,
        [
            f"data={data}",
            f"output_dir={out}",
            f"model.path={tiny}",
            "model.device=cpu",
            "steps=2",
            "sequences_per_step=4",
            "micro_batch_tokens=1200",
            "optim.lr=1e-3",
            "save_every=1",
            *overrides,
        ],
    )


@pytest.mark.slow
def test_sft_two_steps_then_resume_from_step_one(
    tiny: Path, replay_trajectories: Path, tmp_path: Path
) -> None:
    full = tmp_path / "full"
    train_sft(sft_config(tiny, replay_trajectories, full))
    losses = [m["train/loss"] for m in read_metrics(full)]
    assert len(losses) == 2 and all(loss > 0 for loss in losses)

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "step-1", resumed / "step-1")
    train_sft(sft_config(tiny, replay_trajectories, resumed), resume=True)
    assert_same_weights(full / "step-2", resumed / "step-2")


def test_a_resumed_log_is_cut_back_to_its_step_and_a_torn_line_ends_it(tmp_path: Path) -> None:
    from memsearcher.rl.distributed import Runtime
    from memsearcher.rl.metrics_log import MetricsLog

    one = Runtime(rank=0, world_size=1, device=torch.device("cpu"))
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in (1, 2, 3)))
    MetricsLog(tmp_path, one, tensorboard=False, start=2)
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2]
    log.write_text(json.dumps({"step": 1}) + '\n{"step": 2, "x"\n' + json.dumps({"step": 2}))
    MetricsLog(tmp_path, one, tensorboard=False, start=5)
    assert [m["step"] for m in read_metrics(tmp_path)] == [1]
    MetricsLog(tmp_path, one, tensorboard=False, start=0)  # a fresh run leaves the file be
    assert [m["step"] for m in read_metrics(tmp_path)] == [1]


def test_resume_without_a_checkpoint_is_a_clear_error(
    tiny: Path, replay_trajectories: Path, tmp_path: Path
) -> None:
    with pytest.raises(MemSearcherError, match="no checkpoint in"):
        train_sft(sft_config(tiny, replay_trajectories, tmp_path / "none"), resume=True)


class _Payload:
    """Unpickling this runs ``touch``, as any pickle may run code."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.path,))


@pytest.mark.slow
@pytest.mark.parametrize("target", ["optimizer.pt", "rng-rank0.json", "scheduler.json"])
def test_resuming_a_crafted_checkpoint_runs_nothing_and_says_why(
    tiny: Path, replay_trajectories: Path, tmp_path: Path, target: str
) -> None:
    """Someone else's checkpoint is safe to resume: a pickle that would run code in any of
    its state files is refused (no file written), with an error that names the file."""
    from memsearcher.errors import MemSearcherError

    out = tmp_path / "out"
    train_sft(sft_config(tiny, replay_trajectories, out, "steps=1"))
    ran = tmp_path / "ran"
    torch.save({"state": _Payload(ran), "param_groups": []}, out / "step-1" / target)
    with pytest.raises(MemSearcherError, match=target.replace(".", r"\.")):
        train_sft(sft_config(tiny, replay_trajectories, out, "steps=2"), resume=True)
    assert not ran.exists()


@pytest.mark.slow
@pytest.mark.parametrize("aggregation", ["token-mean", "sequence-mean", "trajectory-mean"])
def test_accumulation_over_micro_batches_equals_one_big_batch(
    tiny: Path, questions: Path, tmp_path: Path, length_reward: str, aggregation: str
) -> None:
    """The same step with the mini-batch in one pass or split into many micro-batches has the
    same gradient (its norm, before clipping, is logged) and ends in the same weights: the
    per-micro-batch weights make accumulation exact. The norm matters because Adam's first
    update is nearly scale-free, so equal weights alone would not catch a uniform error."""
    ends, norms = [], []
    for budget in (100_000, 700):
        out = tmp_path / str(budget)
        config = grpo_config(
            tiny, questions, out, f"reward={length_reward}", "steps=1",
            f"aggregation={aggregation}", f"micro_batch_tokens={budget}", "optim.lr=1e-4",
            "optim.max_grad_norm=0", "sample_every=0", "tensorboard=false",
        )  # fmt: skip
        train_grpo(config)
        ends.append(out / "step-1")
        norms.append(read_metrics(out)[0]["train/grad_norm"])
    assert norms[0] == pytest.approx(norms[1], rel=1e-4)
    wa, wb = weights(ends[0]), weights(ends[1])
    for key in wa:
        torch.testing.assert_close(wa[key], wb[key], rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("agent, advantage", [("memsearcher", "grpo"), ("mem1", "gae")])
def test_the_packed_learner_trains_the_step_the_per_turn_one_does(
    tiny: Path, questions: Path, tmp_path: Path, length_reward: str, agent: str, advantage: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """``learner: packed`` in `train_grpo` (GRPO) and `train_ppo` (PPO with a critic): the
    same step's gradient (its norm before clipping is logged) and weights as per turn, with
    every policy pass of the update computed packed."""
    import memsearcher.rl.learner as learner_module

    packed_passes = []
    real = learner_module.packed_sequence_logprobs

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        packed_passes.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(learner_module, "packed_sequence_logprobs", counted)
    ends, norms = [], []
    for learner in ("per-turn", "packed"):
        out = tmp_path / learner
        config = grpo_config(
            tiny, questions, out, f"reward={length_reward}", "steps=1", f"agent_name={agent}",
            f"advantage={advantage}", f"learner={learner}", "optim.lr=1e-4",
            "optim.max_grad_norm=0", "sample_every=0", "tensorboard=false",
            *(["beta=0", "critic.lr=1e-3"] if advantage == "gae" else []),
        )  # fmt: skip
        train_grpo(config)
        assert bool(packed_passes) == (learner == "packed")
        ends.append(out / "step-1")
        norms.append(read_metrics(out)[0]["train/grad_norm"])
    assert norms[0] > 0
    assert norms[1] == pytest.approx(norms[0], rel=1e-5)
    wa, wb = weights(ends[0]), weights(ends[1])
    for key in wa:
        torch.testing.assert_close(wb[key], wa[key], rtol=1e-4, atol=1e-6, msg=key)


def test_the_packed_learner_refuses_what_it_cannot_run(tiny: Path, questions: Path) -> None:
    from transformers import AutoModelForCausalLM

    from memsearcher.rl.packing import mask_kind_of

    with pytest.raises(MemSearcherError, match="share_prefix must be false with learner: packed"):
        grpo_config(tiny, questions, Path("unused"), "learner=packed", "share_prefix=true")
    with pytest.raises(MemSearcherError, match="learner must be one of"):
        grpo_config(tiny, questions, Path("unused"), "learner=stacked")
    model = AutoModelForCausalLM.from_pretrained(tiny, attn_implementation="eager")
    assert mask_kind_of(model) == "additive"
    model.config._attn_implementation = "flash_attention_2"  # as loaded on a GPU with it
    with pytest.raises(MemSearcherError, match="needs a 2-D attention mask"):
        mask_kind_of(model)


@pytest.mark.slow
def test_lora_with_kl_to_the_adapter_free_model_and_resume(
    tiny: Path, questions: Path, tmp_path: Path, length_reward: str
) -> None:
    lora = ["model.lora_rank=4", "model.lora_targets=[q_proj,v_proj]", f"reward={length_reward}"]
    full = tmp_path / "full"
    train_grpo(grpo_config(tiny, questions, full, *lora))
    assert (full / "step-2" / "model" / "adapter_model.safetensors").is_file()
    assert "train/kl" in read_metrics(full)[0]
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(full / "step-1", resumed / "step-1")
    train_grpo(grpo_config(tiny, questions, resumed, *lora), resume=True)
    a = load_file(full / "step-2" / "model" / "adapter_model.safetensors")
    b = load_file(resumed / "step-2" / "model" / "adapter_model.safetensors")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-6, atol=1e-7, msg=key)


def test_degenerate_groups_are_counted_and_can_be_filtered(
    tiny: Path, questions: Path, tmp_path: Path
) -> None:
    """The untrained model never answers: graded reward 0 everywhere, every group degenerate.
    Filtered, nothing is left to train on: no update runs, and the step still completes."""
    out = tmp_path / "out"
    train_grpo(grpo_config(tiny, questions, out, "steps=1", "filter_degenerate=true", "beta=0"))
    (metrics,) = read_metrics(out)
    assert metrics["rollout/degenerate_groups"] == 4
    assert metrics["rollout/degenerate_fraction"] == 1.0
    assert metrics["train/skipped_updates"] == 2
    assert_same_weights_as_model(tiny, out / "step-1")


@pytest.mark.slow
def test_a_step_without_signal_leaves_weights_optimizer_and_schedule_alone(
    tiny: Path, questions: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step 1 has varied rewards and trains; step 2's groups are all degenerate and filtered.
    A zero-gradient AdamW step would still move every weight along its moments (about 2/3 of
    the previous step's move) and the warm-up would advance: step 2 must change nothing."""
    calls = []

    def reward(trajectory: Trajectory) -> float:
        calls.append(1)
        if len(calls) > 12:  # step 2 (4 questions x 3 trajectories per step): one value
            return 0.0
        return float(len(trajectory.turns[0].action_text) % 5) / 5 if trajectory.turns else 0.0

    monkeypatch.setitem(REWARDS, "test-first-step-only", reward)
    out = tmp_path / "out"
    overrides = ["reward=test-first-step-only", "filter_degenerate=true", "beta=0"]
    train_grpo(grpo_config(tiny, questions, out, *overrides, "optim.warmup_steps=10"))
    first, second = read_metrics(out)
    assert first["train/skipped_updates"] == 0 and first["train/grad_norm"] > 0
    assert second["rollout/degenerate_fraction"] == 1.0
    assert second["train/skipped_updates"] == 2
    assert second["train/lr"] == first["train/lr"]  # the warm-up did not advance
    a, b = weights(out / "step-1"), weights(out / "step-2")
    for key in a:
        assert torch.equal(a[key], b[key]), key
    moments = [
        torch.load(out / s / "optimizer.pt", weights_only=True) for s in ("step-1", "step-2")
    ]
    for key, state in moments[0]["state"].items():
        assert torch.equal(state["exp_avg"], moments[1]["state"][key]["exp_avg"])
    schedules = [(out / s / "scheduler.json").read_text() for s in ("step-1", "step-2")]
    assert schedules[0] == schedules[1]


def assert_same_weights_as_model(folder: Path, checkpoint: Path) -> None:
    start, end = weights_of_model(folder), weights(checkpoint)
    for key, value in end.items():
        assert torch.equal(start[key], value), key


@pytest.mark.slow
def test_react_trajectories_train_as_single_sequences(
    tiny: Path, questions: Path, tmp_path: Path, length_reward: str
) -> None:
    out = tmp_path / "out"
    config = grpo_config(
        tiny, questions, out, "agent_name=react", f"reward={length_reward}", "steps=1"
    )
    train_grpo(config)
    (metrics,) = read_metrics(out)
    assert metrics["rollout/sequences"] == 4 * 3  # one per trajectory
    assert metrics["train/grad_norm"] > 0


def test_cli_trains_sft_and_prints_where(
    tiny: Path, replay_trajectories: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from memsearcher.cli import main

    preset = tmp_path / "sft.yaml"
    preset.write_text(f"data: {replay_trajectories}\nsequences_per_step: 4\ntensorboard: false\n")
    out = tmp_path / "out"
    argv = ["train", "sft", "--config", str(preset), f"output_dir={out}", f"model.path={tiny}"]
    assert main([*argv, "model.device=cpu", "steps=1"]) == 0
    assert f"checkpoints in {out}" in capsys.readouterr().out
    assert (out / "step-1" / "model" / "model.safetensors").is_file()
    assert main([*argv, "model.device=cpu", "steps=1", "optim.lrr=1"]) == 2
    assert "valid keys: optim.lr" in capsys.readouterr().err


@pytest.mark.slow
def test_bfloat16_autocast_over_float32_weights(
    tiny: Path, questions: Path, tmp_path: Path, length_reward: str
) -> None:
    """The paper-scale preset's precision: float32 weights (so that lr 1e-6 updates are not
    rounded away), bfloat16 forward passes. The update stays on-policy: old log-probs are
    computed under the same autocast."""
    out = tmp_path / "out"
    overrides = ["model.autocast=bfloat16", f"reward={length_reward}", "steps=1", "beta=0.01"]
    train_grpo(grpo_config(tiny, questions, out, *overrides, "mini_batch_questions=4"))
    (metrics,) = read_metrics(out)
    assert metrics["train/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["train/grad_norm"] > 0
    assert all(v.dtype == torch.float32 for v in weights(out / "step-1").values())


def test_the_reference_copy_is_held_in_the_compute_dtype(tiny: Path) -> None:
    """Under bfloat16 autocast the frozen KL reference is a bfloat16 copy (half the memory of
    a float32 one), and its log-probs under autocast stay those of the float32 reference."""
    from transformers import AutoModelForCausalLM

    from memsearcher.rl.batching import collate, sequence_logprobs
    from memsearcher.rl.policy import Precision, frozen_copy
    from memsearcher.types import TokenSequence

    model = AutoModelForCausalLM.from_pretrained(tiny)
    reference = frozen_copy(model, Precision(torch.float32, "bfloat16"))
    assert {p.dtype for p in reference.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert not any(p.requires_grad for p in reference.parameters())
    sequence = TokenSequence(tuple(range(10, 40)), tuple(range(50, 70)), (1,) * 20)
    batch = collate([sequence], [0], pad_id=0)
    with torch.no_grad():
        full = sequence_logprobs(model, batch, compute="bfloat16")
        half = sequence_logprobs(reference, batch, compute="bfloat16")
    torch.testing.assert_close(half, full, rtol=0, atol=0.05)
    plain = frozen_copy(model, Precision(torch.float32, None))
    assert {p.dtype for p in plain.parameters()} == {torch.float32}


def train_cli(trainer: str, out: Path, *overrides: str, resume: bool = False) -> int:
    from memsearcher.cli import main

    flags = ["--resume"] if resume else []
    return main(["train", trainer, *flags, f"output_dir={out}", "tensorboard=false", *overrides])


def checkpoint_bytes(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_fresh_sft_run_refuses_a_used_folder_and_resume_refuses_another_config(
    tiny: Path, replay_trajectories: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    run = [f"data={replay_trajectories}", f"model.path={tiny}", "model.device=cpu",
           "sequences_per_step=4", "micro_batch_tokens=1200", "save_every=1"]  # fmt: skip
    assert train_cli("sft", out, *run, "steps=3", "optim.lr=1e-3") == 0
    before = checkpoint_bytes(out)
    capsys.readouterr()

    assert train_cli("sft", out, *run, "steps=2", "optim.lr=1e-4", "seed=7") == 2
    err = capsys.readouterr().err
    assert f"{out} already holds checkpoints" in err and "--resume" in err, err
    assert train_cli("sft", out, *run, "steps=3", "optim.lr=1e-4", "seed=7", resume=True) == 2
    err = capsys.readouterr().err
    assert f"{out} holds a run with other settings (optim.lr, seed)" in err, err
    assert checkpoint_bytes(out) == before  # nothing replaced, nothing appended

    # more steps, and another logging and saving cadence, continue the same run
    assert train_cli("sft", out, *run, "steps=4", "optim.lr=1e-3", "log_every=2", resume=True) == 0
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]
    assert latest_checkpoint(out) == out / "step-4"


ONE_GRPO_STEP = ["steps=1", "questions_per_step=4", "mini_batch_questions=2", "group_size=2",
                 "agent.max_new_tokens=8", "agent.memory_tokens=8", "agent.max_turns=1",
                 "micro_batch_tokens=1600"]  # fmt: skip
"""A GRPO run of one small step, for the tests of refusals and resuming."""


@pytest.mark.slow
def test_grpo_and_ppo_refuse_a_used_folder_and_a_changed_config(
    tiny: Path, questions: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    run = [f"data={questions}", f"model.path={tiny}", "model.device=cpu", *ONE_GRPO_STEP]
    assert train_cli("grpo", out, *run) == 0
    before = checkpoint_bytes(out)
    capsys.readouterr()
    for trainer in ("grpo", "ppo"):
        assert train_cli(trainer, out, *run) == 2
        err = capsys.readouterr().err
        assert f"{out} already holds checkpoints" in err and "--resume" in err, err
    assert train_cli("grpo", out, *run, "beta=0.5", resume=True) == 2
    assert "other settings (beta)" in capsys.readouterr().err
    assert train_cli("ppo", out, *run, resume=True) == 2
    assert "other settings (advantage)" in capsys.readouterr().err
    assert checkpoint_bytes(out) == before


def test_a_run_saved_before_a_config_key_existed_resumes_at_its_default(
    tiny: Path, questions: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run saved before a key was added (its config.json lacks it) resumes when the key is
    at its default, as the run then behaved; set to anything else, the key is a change."""
    out = tmp_path / "out"
    run = [f"data={questions}", f"model.path={tiny}", "model.device=cpu", *ONE_GRPO_STEP]
    assert train_cli("grpo", out, *run) == 0
    saved = json.loads((out / "config.json").read_text())
    for key in ("environment", "shop_split", "shop"):  # keys added on 2026-12-04
        del saved[key]
    del saved["agent"]["max_top_n"]
    (out / "config.json").write_text(json.dumps(saved))
    capsys.readouterr()
    assert train_cli("grpo", out, *run, "shop_split=test", resume=True) == 2
    assert "other settings (shop_split)" in capsys.readouterr().err
    assert train_cli("grpo", out, *run, "steps=2", resume=True) == 0
    assert [m["step"] for m in read_metrics(out)] == [1, 2]


@pytest.fixture(scope="module")
def one_step(
    tiny: Path, replay_trajectories: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """A real run's first checkpoint, for the damage tests to copy."""
    out = tmp_path_factory.mktemp("one-step")
    train_sft(sft_config(tiny, replay_trajectories, out, "steps=1"))
    return out / "step-1"


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "truncated weights": ("model/model.safetensors", _truncate, "model.safetensors"),
    "empty optimizer": ("optimizer.pt", lambda p: p.write_bytes(b""), "optimizer.pt"),
    "state a list": ("state.json", lambda p: p.write_text("[]"), "state.json.*'step'"),
    "state without step": (
        "state.json",
        lambda p: p.write_text('{"world_size": 1}'),
        "state.json.*'step'",
    ),
    "foreign scheduler": (
        "scheduler.json",
        lambda p: p.write_text('{"T_max": 10, "eta_min": 0}'),
        "scheduler.json.*schedule",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_checkpoint_names_its_file(
    tiny: Path, replay_trajectories: Path, tmp_path: Path, one_step: Path, damage: str
) -> None:
    target, spoil, message = DAMAGE[damage]
    out = tmp_path / "out"
    shutil.copytree(one_step, out / "step-1")
    spoil(out / "step-1" / target)
    with pytest.raises(MemSearcherError, match=message):
        train_sft(sft_config(tiny, replay_trajectories, out, "steps=2"), resume=True)
    assert not (out / "step-2").exists()


@pytest.mark.slow
def test_a_published_checkpoint_was_synced_before_its_rename(
    tiny: Path, replay_trajectories: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A power cut after the rename must not leave a step-N of empty files: every file is
    fsynced while it still lies in the staging folder. os.fsync is wrapped (and still runs) to
    see which files it reached; no disk here can be made to lose power."""
    import os

    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    out = tmp_path / "out"
    train_sft(sft_config(tiny, replay_trajectories, out, "steps=1"))
    staged = {
        str(out / ".step-1.tmp" / p.relative_to(out / "step-1"))
        for p in (out / "step-1").rglob("*")
        if p.is_file()
    }
    assert staged and staged <= set(synced)


@pytest.mark.slow
def test_resume_from_a_chosen_step_replays_the_run_from_there(
    tiny: Path, replay_trajectories: Path, tmp_path: Path
) -> None:
    """`--resume-from step-N`: a damaged or unwanted newer checkpoint need not be the start."""
    out = tmp_path / "out"
    run = [f"data={replay_trajectories}", f"model.path={tiny}", "model.device=cpu",
           "sequences_per_step=4", "micro_batch_tokens=1200", "save_every=1"]  # fmt: skip
    run.append("steps=3")
    assert train_cli("sft", out, *run) == 0
    first = weights(out / "step-3")
    (out / "step-3" / "optimizer.pt").write_bytes(b"")  # damaged: --resume would stop on it
    assert train_cli("sft", out, *run, "--resume-from", "step-1") == 0
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]
    again = weights(out / "step-3")
    assert first.keys() == again.keys()
    for key in first:
        torch.testing.assert_close(first[key], again[key], rtol=1e-6, atol=1e-7, msg=key)
