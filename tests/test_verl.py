"""Our agents inside veRL, driven through veRL's own classes on the CPU.

The path is the V1 trainer's, step for step:

- ``memsearcher verl prepare`` writes the parquet, and veRL's ``RLHFDataset`` and
  ``collate_fn`` read it into the batch the trainer submits (a ``uid`` per question);
- veRL's ``AgentLoopWorkerTQ`` (the class inside its Ray actor), built from a veRL config
  composed from its own ``ppo_trainer.yaml``, loads our agent-loop YAML and runs
  ``generate_sequences``: ``rollout.n`` sessions per question, each building our loop with
  ``hydra.utils.instantiate`` and veRL's wrappers, awaiting ``run()``, then post-processing
  the outputs (reward copied to every row, ``as_dict``, fields packed for TransferQueue);
- generations go through veRL's ``LLMServerClient.generate`` to a replica over our HF backend
  serving a real model (a tiny Llama, warm-started by SFT so that it searches);
- the trainer's own ``_compute_advantage`` reads the rows back and runs
  ``compute_advantage_for_multi_trajectories``.

Stand-ins, because they need Ray actors or a GPU: the replica behind the client (our
``HFModel`` instead of vLLM), TransferQueue's store (a dict, packed with TransferQueue's own
packer), and the actor's old log-probs (a teacher-forced pass of the same model).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("verl", reason="needs pip install 'memsearcher[verl]'")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402
from _policies import follow_plans, search_once_then_answer  # noqa: E402
from _servers import free_port, running  # noqa: E402
from _verl_server import HFReplica, LocalServerClient, MemoryTQ  # noqa: E402
from hydra import compose, initialize_config_module  # noqa: E402
from tiny_model import save_thinking_model, save_tiny_model  # noqa: E402

from memsearcher.agent import AGENTS, AgentConfig, Templates, run_lockstep, start_episodes  # noqa: E402
from memsearcher.agent.environments.shop import (  # noqa: E402
    ShopEnv,
    ShopEnvironment,
    ShopSearch,
    instruction_example,
    solve,
)
from memsearcher.agent.environments.shop_world import ShopConfig, generate_catalogue  # noqa: E402
from memsearcher.agent.shop_agents import start_shop_episodes  # noqa: E402
from memsearcher.cli import main as cli  # noqa: E402
from memsearcher.errors import MemSearcherError  # noqa: E402
from memsearcher.integrations.verl import check_trainer_config  # noqa: E402
from memsearcher.llm.base import SamplingParams  # noqa: E402
from memsearcher.llm.hf import HFModel, HFTokenizer  # noqa: E402
from memsearcher.llm.scripted import ScriptedLLM  # noqa: E402
from memsearcher.retrieval.base import Retriever  # noqa: E402
from memsearcher.retrieval.client import HTTPRetriever  # noqa: E402
from memsearcher.rl.advantages import group_advantages  # noqa: E402
from memsearcher.rl.config import SFTConfig, load_config  # noqa: E402
from memsearcher.rl.rewards import trajectory_reward  # noqa: E402
from memsearcher.rl.train_sft import train_sft  # noqa: E402
from memsearcher.types import QAExample  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_LOOPS = ROOT / "configs" / "verl" / "agent_loop.yaml"
TEMPLATES = {
    "memsearcher_system": "Search, then answer in a box.",
    "memsearcher_tool_response": (
        "<tool_response>\n{passages}\n</tool_response>\nUpdate your memory."
    ),
    "react_system": "Search, then answer in a box.",
    "mem1_user": "Search in <search> </search>, answer in <answer> </answer>: {questions}",
}
AGENT = {"max_turns": 2, "memory_tokens": 16, "max_new_tokens": 48, "top_n": 1}
PLACES = ["France", "the Seine"]
QUESTIONS = [QAExample(f"q{i}", f"Which city has {p}?", ("Paris",)) for i, p in enumerate(PLACES)]
SFT_STEPS = 80  # measured: greedy, each agent then searches, then answers (at 60 MemSearcher not)


@pytest.fixture(scope="module")
def warm(tmp_path_factory: pytest.TempPathFactory, retriever: Retriever) -> Path:
    """A tiny Llama taught every agent's protocol by a short SFT, answering Paris or London: it
    searches once, then answers, so each agent's trajectories have several turns, and sampled
    groups disagree on the answer."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("verl-model")
    tiny = save_tiny_model(folder / "tiny")
    tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(tiny))
    trajectories = []
    for agent, answer in itertools.product(sorted(AGENTS), ("Paris", "London")):
        episodes = start_episodes(
            agent, QUESTIONS, tokenizer, AgentConfig(**AGENT), Templates(**TEMPLATES)
        )
        trajectories += run_lockstep(
            episodes,
            ScriptedLLM(tokenizer, search_once_then_answer(answer)),
            retriever,
            SamplingParams(),
        )
    data = folder / "sft.jsonl"
    data.write_text("".join(json.dumps(t.to_dict()) + "\n" for t in trajectories))
    sft = load_config(
        SFTConfig,
        None,
        [f"data={data}", f"output_dir={folder / 'sft'}", f"model.path={tiny}", "model.device=cpu",
         f"steps={SFT_STEPS}", "sequences_per_step=8", "optim.lr=5e-3",
         f"save_every={SFT_STEPS}", "tensorboard=false"],
    )  # fmt: skip
    train_sft(sft)
    return folder / "sft" / f"step-{SFT_STEPS}" / "model"


@pytest.fixture(scope="module")
def llm(warm: Path) -> HFModel:
    return HFModel.from_pretrained(str(warm), device="cpu")


def prepare(folder: Path, agent: str) -> Path:
    """The questions as FlashRAG JSONL, turned into veRL's parquet by our CLI."""
    jsonl = folder / "questions.jsonl"
    jsonl.write_text(
        "".join(
            json.dumps(
                {"id": q.id, "question": q.question, "golden_answers": list(q.golden_answers)}
            )
            + "\n"
            for q in QUESTIONS
        )
    )
    out = folder / f"{agent}.parquet"
    assert cli(["verl", "prepare", "--data", str(jsonl), "--agent", agent, "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def retrieval_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real retrieval server (embedded BM25) on 127.0.0.1, as on a cluster."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "memsearcher.cli", "retriever", "serve", "--port", str(port)]
    log = tmp_path_factory.mktemp("retriever") / "server.log"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    with running(command, f"{url}/health", log, env):
        yield url


def agent_loops(folder: Path, templates: Path, retriever: str | None) -> Path:
    """The shipped agent-loop YAML with the tiny setup's agent settings and templates; names,
    classes and the retriever setting are the shipped ones (None: the in-process BM25)."""
    entries = yaml.safe_load(SHIPPED_LOOPS.read_text())
    for entry in entries:
        entry["agent_config"] = dict(AGENT)
        entry["templates"] = str(templates)
        if retriever is None:
            entry["retriever"] = None
    path = folder / "agent_loop.yaml"
    path.write_text(yaml.safe_dump(entries))
    return path


def verl_config(model: Path, loops: Path, *overrides: str, length: int = 1024) -> Any:
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(
            config_name="ppo_trainer",
            overrides=[
                f"actor_rollout_ref.model.path={model}",
                "actor_rollout_ref.rollout.name=vllm",
                f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
                "algorithm.adv_estimator=grpo",
                f"data.max_prompt_length={length}",
                f"data.max_response_length={length}",
                *overrides,
            ],
        )


@pytest.fixture()
def store(monkeypatch: pytest.MonkeyPatch) -> MemoryTQ:
    from verl.trainer.ppo.v1 import agent_loop_tq, trainer_base

    memory = MemoryTQ()
    monkeypatch.setattr(agent_loop_tq, "tq", memory)
    monkeypatch.setattr(trainer_base, "tq", memory)
    return memory


def rollout(config: Any, llm: HFModel, parquet: Path) -> tuple[Any, LocalServerClient]:
    """Submit every question of ``parquet`` as the V1 trainer does; wait for all sessions."""
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ
    from verl.utils import tensordict_utils as tu
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    client = LocalServerClient(config, HFReplica(llm, global_steps=1))
    worker = AgentLoopWorkerTQ.__ray_actor_class__(config, client)
    dataset = RLHFDataset(str(parquet), worker.tokenizer, config.data)
    batch_dict = collate_fn([dataset[i] for i in range(len(dataset))])
    batch_dict["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(dataset))], dtype=object)
    batch = tu.get_tensordict(batch_dict)
    tu.assign_non_tensor_data(batch, "global_steps", 1)

    async def submit() -> None:
        await worker.generate_sequences(batch)
        await asyncio.gather(*list(worker.background_tasks))

    asyncio.run(submit())
    return batch, client


def sessions(store: MemoryTQ) -> dict[str, list[str]]:
    """Row keys ``{uid}_{session}_{row}`` by session, rows in order."""
    found: dict[str, list[str]] = {}
    for key in sorted(store.rows, key=lambda k: (k.rsplit("_", 1)[0], int(k.rsplit("_", 1)[1]))):
        found.setdefault(key.rsplit("_", 1)[0], []).append(key)
    return found


def assert_rows_are(rows: list[dict[str, Any]], trajectory: Any) -> None:
    """A session's rows are the trajectory's training sequences, token for token."""
    assert len(rows) == len(trajectory.sequences)
    for row, sequence in zip(rows, trajectory.sequences, strict=True):
        assert row["prompts"].tolist() == list(sequence.prompt_ids)
        assert row["responses"].tolist() == list(sequence.response_ids)
        assert row["response_mask"].tolist() == list(sequence.loss_mask)


def row_logprobs(
    llm: HFModel, prompt: torch.Tensor, response: torch.Tensor, temperature: float
) -> torch.Tensor:
    """(len(response),) log-probs of a row's response tokens in one teacher-forced pass: what
    veRL's actor computes as old log-probs."""
    replica = HFReplica(llm)
    return torch.tensor(replica.logprobs(prompt.tolist(), response.tolist(), temperature))


def write_templates(folder: Path) -> Path:
    path = folder / "templates.yaml"
    path.write_text(yaml.safe_dump(TEMPLATES))
    return path


@pytest.mark.parametrize("loops", ["agent_loop.yaml", "agent_loop_shop.yaml"])
def test_shipped_agent_loops_cover_every_agent(loops: str) -> None:
    entries = yaml.safe_load((ROOT / "configs" / "verl" / loops).read_text())
    names = {entry["name"] for entry in entries}
    assert set(AGENTS) <= names, f"configs/verl/agent_loop.yaml lacks {set(AGENTS) - names}"
    for entry in entries:
        assert entry["name"] == entry["agent"]
        assert entry["_target_"] == "memsearcher.integrations.verl.agent_loop.MemSearcherAgentLoop"


@pytest.mark.slow
@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_greedy_rows_equal_the_lockstep_driver(
    agent: str,
    warm: Path,
    llm: HFModel,
    retrieval_server: str,
    store: MemoryTQ,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under greedy decoding each question's rows are, token for token, the training sequences
    our lockstep driver produces, searching the same retrieval server over HTTP; the reward is
    ``trajectory_reward``."""
    monkeypatch.setenv("MEMSEARCHER_RETRIEVER", retrieval_server)  # read by the shipped YAML
    loops = agent_loops(tmp_path, write_templates(tmp_path), retriever=retrieval_server)
    config = verl_config(
        warm, loops, "actor_rollout_ref.rollout.n=1", "actor_rollout_ref.rollout.temperature=0"
    )
    rollout(config, llm, prepare(tmp_path, agent))

    with HTTPRetriever(retrieval_server) as http:
        episodes = start_episodes(
            agent, QUESTIONS, llm.tokenizer, AgentConfig(**AGENT), Templates(**TEMPLATES),
            llm.max_context_tokens,
        )  # fmt: skip
        expected = {t.example.id: t for t in run_lockstep(episodes, llm, http, SamplingParams())}

    found = sessions(store)
    assert len(found) == len(QUESTIONS)
    for keys in found.values():
        rows = [store.rows[k] for k in keys]
        trajectory = expected[rows[0]["extra_info"]["id"]]
        assert_rows_are(rows, trajectory)
        for row in rows:
            assert row["num_turns"] == len(trajectory.turns)
            # veRL copies the final row's reward to every row; rm_scores holds it on the last token
            assert row["rm_scores"][-1].item() == pytest.approx(trajectory_reward(trajectory))
            assert row["rm_scores"][:-1].abs().sum() == 0
        info = rows[-1]["extra_fields"]["reward_extra_info"]
        assert info["score"] == pytest.approx(trajectory_reward(trajectory))
        assert info["turns"] == len(trajectory.turns)
        assert info["searches"] == trajectory.num_searches
        assert info["end_reason"] == trajectory.end_reason
    # The warm-up taught every protocol: some trajectory searched, then took another turn.
    infos = [store.rows[keys[-1]]["extra_fields"]["reward_extra_info"] for keys in found.values()]
    searched = [
        keys
        for keys, info in zip(found.values(), infos, strict=True)
        if info["searches"] >= 1 and info["turns"] > 1
    ]
    assert searched, f"{agent}: no trajectory searched, then took another turn: {infos}"
    for keys in searched:
        masks = [store.rows[k]["response_mask"].tolist() for k in keys]
        if agent == "react":  # one growing conversation: one row, tool responses under mask 0
            assert len(keys) == 1 and 0 in masks[0]
        elif agent == "memsearcher":  # a row a turn, the tool response under mask 0 in its row
            assert len(keys) == store.rows[keys[-1]]["num_turns"] and 0 in masks[0]
        else:  # MEM1: a row a turn, all generated; the observation and hint open the next prompt
            assert len(keys) == store.rows[keys[-1]]["num_turns"]
            assert not any(0 in mask for mask in masks)
            assert "<information>[HINT]" in llm.tokenizer.decode(
                store.rows[keys[1]]["prompts"].tolist()
            )


@pytest.mark.slow
def test_group_advantages_reach_every_turn_row(
    warm: Path, llm: HFModel, store: MemoryTQ, tmp_path: Path
) -> None:
    """Sampled groups, advantages by veRL's trainer: every row of a trajectory carries the
    trajectory's GRPO advantage on its mask-1 tokens and 0 under mask 0, and it equals our own
    ``group_advantages`` over ``trajectory_reward``; rollout log-probs line up with the row."""
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    group = 4
    loops = agent_loops(tmp_path, write_templates(tmp_path), retriever=None)  # in-process BM25
    config = verl_config(
        warm, loops, f"actor_rollout_ref.rollout.n={group}",
        "actor_rollout_ref.rollout.temperature=0.7",
    )  # fmt: skip
    torch.manual_seed(0)
    _, client = rollout(config, llm, prepare(tmp_path, "memsearcher"))
    found = sessions(store)
    assert len(found) == len(QUESTIONS) * group
    # one request id per trajectory (veRL keeps it on one server), reused by each of its calls
    assert len(set(client.sessions)) == len(found) <= len(client.sessions)

    for key, row in store.rows.items():  # the actor's old log-probs, as the trainer would have
        old = row_logprobs(llm, row["prompts"], row["responses"], temperature=0.7)
        mask = row["response_mask"].bool()
        assert torch.allclose(row["rollout_log_probs"][mask], old[mask], atol=1e-4), key
        assert (row["rollout_log_probs"][~mask] == 0).all()
        row["old_log_probs"] = old

    keys = list(store.rows)
    trainer = PPOTrainerSync.__new__(PPOTrainerSync)  # only its config is read here
    trainer.config = config
    trainer._compute_advantage(
        KVBatchMeta(keys=keys, tags=[{}] * len(keys), partition_id="train"), {}
    )

    by_question: dict[str, list[str]] = {}
    for session in found:
        by_question.setdefault(session.rsplit("_", 1)[0], []).append(session)
    nonzero = multi_row = masked = 0
    for members in by_question.values():
        members.sort(key=lambda s: int(s.rsplit("_", 1)[1]))
        rewards = torch.tensor([store.rows[found[s][-1]]["rm_scores"][-1].item() for s in members])
        expected, _ = group_advantages(rewards, group)
        for session, advantage in zip(members, expected.tolist(), strict=True):
            multi_row += len(found[session]) > 1
            nonzero += advantage != 0
            for key in found[session]:
                row = store.rows[key]
                mask = row["response_mask"].bool()
                assert torch.allclose(row["advantages"][mask], torch.tensor(advantage), atol=1e-5)
                assert (row["advantages"][~mask] == 0).all()
                masked += int((~mask).sum())
    assert nonzero and multi_row and masked, (nonzero, multi_row, masked)


SHOP_LOOPS = ROOT / "configs" / "verl" / "agent_loop_shop.yaml"
SHOP = ShopConfig(seed=0, families_per_category=1)


@pytest.mark.slow
@pytest.mark.parametrize("agent", sorted(AGENTS))
def test_shop_rows_equal_the_lockstep_driver(agent: str, store: MemoryTQ, tmp_path: Path) -> None:
    """The shipped shop loops (configs/verl/agent_loop_shop.yaml) on the generated shop's test
    instructions, two sessions each, with a scripted shopper playing the oracle's plans: every
    session's rows are, token for token, the sequences the lockstep driver makes in the same
    shop, pages under mask 0 (MEM1's in the next prompt), and the reward is the shop's, 1 for
    each purchase; the two sessions of one instruction never meet."""
    from transformers import AutoTokenizer

    model = save_tiny_model(tmp_path / "tiny")  # its tokenizer and context; the shopper writes
    catalogue = generate_catalogue(SHOP)
    test = catalogue.split("test")
    search = ShopSearch(catalogue.products)
    plans = {i.text: solve(ShopEnv(catalogue, search, i)) for i in test}
    tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(model))
    shopper = ScriptedLLM(tokenizer, follow_plans(plans), max_context_tokens=4096)
    # the replica answers with the shopper's text, and the tiny model's log-probs of it
    replica_model = SimpleNamespace(
        generate=shopper.generate, max_context_tokens=4096,
        model=HFModel.from_pretrained(str(model), device="cpu").model,
    )  # fmt: skip
    entries = yaml.safe_load(SHOP_LOOPS.read_text())
    for entry in entries:
        entry["shop"] = {"seed": SHOP.seed, "families_per_category": SHOP.families_per_category}
        entry["agent_config"] = {"max_turns": 15, "memory_tokens": 32, "max_new_tokens": 48}
    loops = tmp_path / "agent_loop_shop.yaml"
    loops.write_text(yaml.safe_dump(entries))
    parquet = tmp_path / "shop.parquet"
    args = ["verl", "prepare", "--env", "shop", "--shop-families", "1", "--shop-split", "test"]
    assert cli([*args, "--agent", agent, "--out", str(parquet)]) == 0
    config = verl_config(
        model, loops, "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.rollout.temperature=0",
        length=8192,
    )  # fmt: skip
    rollout(config, replica_model, parquet)

    settings = AgentConfig(max_turns=15, memory_tokens=32, max_new_tokens=48)
    episodes = start_shop_episodes(agent, [instruction_example(i) for i in test], tokenizer,
                                   settings, None, 4096)  # fmt: skip
    trajectories = run_lockstep(episodes, shopper, ShopEnvironment(catalogue, search),
                                SamplingParams())  # fmt: skip
    expected = {t.example.id: t for t in trajectories}
    assert [t.environment_reward for t in trajectories] == [1.0] * len(test)
    found = sessions(store)
    assert len(found) == 2 * len(test)
    for keys in found.values():
        rows = [store.rows[k] for k in keys]
        trajectory = expected[rows[0]["extra_info"]["id"]]
        assert_rows_are(rows, trajectory)
        assert all(row["rm_scores"][-1].item() == 1.0 for row in rows)
        masks = [m for row in rows for m in row["response_mask"].tolist()]
        assert (0 in masks) == (agent != "mem1")  # pages are tool tokens; MEM1's open prompts


@pytest.mark.slow
def test_apply_chat_template_kwargs_reach_the_rows(store: MemoryTQ, tmp_path: Path) -> None:
    """veRL's ``data.apply_chat_template_kwargs`` render every turn's prompt, as veRL's own
    loops render theirs: with Qwen3's ``enable_thinking=False`` each row's prompt ends in the
    empty think that the template writes, and without it no row's does."""
    model = save_thinking_model(tmp_path / "model")
    llm = HFModel.from_pretrained(str(model), device="cpu")
    loops = agent_loops(tmp_path, write_templates(tmp_path), retriever=None)
    parquet = prepare(tmp_path, "memsearcher")
    endings = {}
    for kwargs in ((), ("+data.apply_chat_template_kwargs.enable_thinking=false",)):
        store.rows.clear()
        config = verl_config(model, loops, "actor_rollout_ref.rollout.n=1", *kwargs)
        rollout(config, llm, parquet)
        assert len(store.rows) >= len(QUESTIONS)
        endings[kwargs] = {
            llm.tokenizer.decode(row["prompts"].tolist()).endswith(
                "<|im_start|>assistant\n<think>\n\n</think>\n\n"
            )
            for row in store.rows.values()
        }
    assert list(endings.values()) == [{False}, {True}]


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("algorithm.adv_estimator=rloo", "adv_estimator=rloo"),
        ("algorithm.adv_estimator=gae", "adv_estimator=gae"),
        ("algorithm.adv_estimator=grpo_vectorized", "N times"),
        ("trainer.use_v1=false", "trainer.use_v1=false"),
        ("algorithm.use_kl_in_reward=true", "use_kl_in_reward"),
        ("actor_rollout_ref.rollout.name=sglang", "sglang with skip_tokenizer_init=true"),
        ("actor_rollout_ref.rollout.name=trtllm", "trtllm with skip_tokenizer_init=true"),
    ],
)
def test_settings_that_would_mistrain_are_refused(
    override: str, needle: str, tmp_path: Path
) -> None:
    config = verl_config(tmp_path / "model", SHIPPED_LOOPS, override)
    with pytest.raises(MemSearcherError, match=needle):
        check_trainer_config(config)


def test_the_loop_refuses_answer_on_repeat() -> None:
    """The option drops a repeated action's tokens, whose log-probs veRL would still lay out
    on the response; it is for inference."""
    from memsearcher.integrations.verl.agent_loop import _agent_config

    assert _agent_config({"max_turns": 3}).max_turns == 3  # the control
    with pytest.raises(MemSearcherError, match="agent_config.answer_on_repeat is for inference"):
        _agent_config({"answer_on_repeat": True})


def test_sglang_rollouts_with_a_tokenizer_are_accepted(tmp_path: Path) -> None:
    """The control of the sglang case above: veRL's default for vLLM, and SGLang told to load
    its tokenizer (veRL's server passes skip_tokenizer_init on to SGLang's engine)."""
    check_trainer_config(verl_config(tmp_path / "model", SHIPPED_LOOPS))
    check_trainer_config(
        verl_config(
            tmp_path / "model", SHIPPED_LOOPS, "actor_rollout_ref.rollout.name=sglang",
            "actor_rollout_ref.rollout.skip_tokenizer_init=false",
        )
    )  # fmt: skip


@pytest.mark.slow
def test_the_loop_refuses_to_be_built_with_another_estimator(tmp_path: Path) -> None:
    """Built as veRL's worker builds it (its wrappers, hydra.utils.instantiate)."""
    import hydra
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap
    from verl.utils.dataset.rl_dataset import RLHFDataset

    tiny = save_tiny_model(tmp_path / "tiny")
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    entry = OmegaConf.load(SHIPPED_LOOPS)[0]

    def build(*overrides: str) -> Any:
        config = verl_config(tiny, SHIPPED_LOOPS, *overrides)
        return hydra.utils.instantiate(
            config=entry, trainer_config=DictConfigWrap(config=config), server_manager=None,
            tokenizer=tokenizer, processor=None, hf_model_type="llama", dataset_cls=RLHFDataset,
            data_config=DictConfigWrap(config.data), tools=ToolListWrap([]),
        )  # fmt: skip

    assert build().agent == "memsearcher"  # the control: grpo builds
    with pytest.raises(Exception, match="only grpo is supported") as caught:
        build("algorithm.adv_estimator=reinforce_plus_plus")
    assert "independent sample" in str(caught.value)

    shop = OmegaConf.load(ROOT / "configs" / "verl" / "agent_loop_shop.yaml")[1]
    entry = OmegaConf.merge(shop, {"shop": {"families_per_category": 1}})
    assert build().open_shop is not None  # the control: the shipped shop entry builds
    for change, needle in [
        ({"reward": "graded"}, "reward: 'graded' with environment shop: use environment"),
        ({"retriever": "http://127.0.0.1:8000"}, "environment shop takes no retriever"),
        ({"environment": "webshop"}, "environment: webshop needs webshop_url"),
        ({"environment": "search", "reward": "graded"}, "environment search takes no shop"),
        ({"environment": "mall"}, "unknown environment 'mall'"),
    ]:
        entry = OmegaConf.merge(shop, {"shop": {"families_per_category": 1}}, change)
        if change.get("environment") == "webshop":
            entry.pop("shop")
        with pytest.raises(Exception, match=re.escape(needle)):  # in hydra's wrapping
            build()


@pytest.mark.slow
def test_entry_point_refuses_before_anything_starts(tmp_path: Path) -> None:
    """``python -m memsearcher.integrations.verl.main`` stops with our message and exit code 2
    before Ray or any model starts."""
    command = [
        sys.executable, "-m", "memsearcher.integrations.verl.main",
        "algorithm.adv_estimator=gae", "actor_rollout_ref.model.path=/nonexistent",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={SHIPPED_LOOPS}",
        f"hydra.run.dir={tmp_path}",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "memsearcher: error:" in result.stderr
    assert "algorithm.adv_estimator=gae" in result.stderr
    assert "ray init" not in result.stdout


def test_length_bias_of_verl_loss_aggregation() -> None:
    """The numbers docs/training.md gives, from veRL's own ``agg_loss``: the gradient weight of
    a 1-turn trajectory (150 generated tokens) and of a 5-turn one (4 x 300 + 150) in one
    batch. With a per-row weight of 1/turns (not in veRL 0.9.1) both would weigh the same."""
    from verl.trainer.ppo.core_algos import agg_loss

    lengths = [150, 300, 300, 300, 300, 150]  # row 0: trajectory A; rows 1-5: trajectory B
    mask = torch.zeros(len(lengths), max(lengths))
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    shares = {}
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        weights = torch.ones_like(mask, requires_grad=True)
        agg_loss(loss_mat=weights, loss_mask=mask, loss_agg_mode=mode).backward()
        per_row = weights.grad.sum(dim=1)  # type: ignore[union-attr]
        shares[mode] = (per_row[1:].sum() / per_row[0]).item()
    assert shares["token-mean"] == pytest.approx(9.0)
    assert shares["seq-mean-token-mean"] == pytest.approx(5.0)
    assert shares["seq-mean-token-sum"] == pytest.approx(9.0)


def paper_preset(tmp_path: Path) -> Any:
    """configs/verl/grpo-qwen2.5-3b.yaml with the launch script's overrides (two nodes)."""
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs" / "verl"), version_base=None):
        return compose(
            config_name="grpo-qwen2.5-3b",
            overrides=[
                f"actor_rollout_ref.model.path={save_tiny_model(tmp_path / 'tiny')}",
                "trainer.nnodes=2",
                "+ray_kwargs.ray_init.address=auto",
                "+ray_kwargs.ray_init.runtime_env.env_vars.MEMSEARCHER_RETRIEVER=http://10.0.0.2:8000",
            ],
        )


def test_paper_preset_passes_verl_validation_and_our_checks(tmp_path: Path) -> None:
    """The preset composes over veRL's own schema, passes the checks veRL's main_ppo runs
    first, and ours."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    config = paper_preset(tmp_path)
    validate_config(
        config=config,
        use_reference_policy=need_reference_policy(config),
        use_critic=False,
    )
    assert not need_critic(config)
    check_trainer_config(config)
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    assert (actor.optim.lr, config.data.train_batch_size) == (1e-6, 256)
    assert (rollout.n, rollout.temperature, rollout.top_p) == (5, 1.0, 0.99)
    assert (actor.use_kl_loss, actor.kl_loss_type, actor.kl_loss_coef) == (
        True,
        "low_var_kl",
        0.001,
    )
    assert omega_conf_to_dataclass(rollout).max_model_len == 4096
    assert rollout.skip_tokenizer_init is False  # SGLang matches our stop strings only so
    env = config.ray_kwargs.ray_init.runtime_env.env_vars
    assert env.MEMSEARCHER_RETRIEVER == "http://10.0.0.2:8000"
    (entry,) = [e for e in yaml.safe_load(SHIPPED_LOOPS.read_text()) if e["name"] == "memsearcher"]
    assert entry["agent_config"]["max_turns"] == 5  # the paper's 5 turns


def test_paper_preset_makes_at_most_the_papers_two_updates_a_step(tmp_path: Path) -> None:
    """The optimizer updates of one step of the preset, as veRL's V1 trainer makes them: the
    step's rows padded to ``_get_required_batch_multiple`` (16 ranks on two nodes), cut into
    the mini-batches ``_update_actor`` asks the actor for. The paper makes 2 (256 questions,
    mini-batches of 128); one row per turn, so the rows depend on the mean turns."""
    from transfer_queue import KVBatchMeta
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    config = paper_preset(tmp_path)
    asked: dict[str, Any] = {}

    class ActorGroup:  # stands in for the Ray worker group: records what the actor is asked
        def update_actor(self, batch: KVBatchMeta) -> dict[str, Any]:
            asked.update(batch.extra_info)
            return {"metrics": {"mfu": [0.0]}}

    trainer = PPOTrainerSync.__new__(PPOTrainerSync)  # only what these two methods read
    trainer.config, trainer.use_critic, trainer.global_steps = config, False, 1
    trainer.actor_rollout_wg = ActorGroup()
    trainer._update_actor(KVBatchMeta(keys=[], tags=[], partition_id="train"), {})
    multiple = trainer._get_required_batch_multiple(dp_size=16)
    trajectories = config.data.train_batch_size * config.actor_rollout_ref.rollout.n
    (entry,) = [e for e in yaml.safe_load(SHIPPED_LOOPS.read_text()) if e["name"] == "memsearcher"]
    max_turns = entry["agent_config"]["max_turns"]

    def updates(mean_turns: float) -> int:
        padded = math.ceil(trajectories * mean_turns / multiple) * multiple
        return padded // asked["mini_batch_size"] * asked["epochs"]

    assert updates(max_turns) == updates(3) == updates(2.6) == 2
    assert updates(2.5) == updates(1) == 1
