"""The copy probe: the demo model, trained here, copies names into the protocol's slots.

Real parts: the demo's world (seed 0, full size), its tokenizer and from-scratch Llama, the
copy warm-up, the real agents driving the teacher through `ScriptedLLM` with the real BM25
index, and the project's SFT trainer. The thresholds are stated in docs/demo.md ("Copy probe").
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from memsearcher.agent import Templates, run_lockstep, start_episodes
from memsearcher.data.flashrag import read_examples
from memsearcher.data.synthetic import generate_world, rename_world, write_world
from memsearcher.demo.copying import (
    copy_sequences,
    copy_update,
    name_token_accuracy,
    question_lookups,
    reply_sequence,
    warm_up_copying,
)
from memsearcher.demo.model import save_demo_model
from memsearcher.demo.pipeline import PRESETS, sft_config
from memsearcher.demo.templates import DEMO_TEMPLATES, tokenizer_texts
from memsearcher.llm import load_tokenizer
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval.bm25 import build_bm25
from memsearcher.rl.train_sft import train_sft
from memsearcher.teach.oracle import oracle_policy
from memsearcher.types import TokenSequence

DEMO = PRESETS["full"]
SFT_STEPS = 150
"""A quarter of the demo's SFT: enough to show copying into the protocol's slots in CI."""
WARM_UP_THRESHOLD = 0.8
"""Top-token accuracy on the names of fresh copy sequences after the warm-up (0.000 before it).
Measured over seeds 0-4 (`pytest --learning-seed N`, which also changes the world and the
model): 1.000, 0.878, 0.985, 1.000, 1.000. Seed 1 copies lists of one and two names perfectly
and lists of three at 0.755; the levers tried on it did not lift it robustly: 1,200 steps gave
0.868, batches of 64 0.600, and half the lr 1.000 on seed 1 but 0.815 on seed 0. Whether a
1M-parameter model learns to copy the third name of a list within the warm-up depends on its
start, so the threshold (0.9 before) sits below the weakest seed, far above the 0.000 the
untrained model copies (issue 33)."""
SFT_THRESHOLD = 0.3
"""Teacher-forced top-token accuracy on the name tokens (2,196 for seed 0) of the ideal agent's
test trajectories after ``SFT_STEPS`` updates on two renamed copies. Measured over seeds 0-4:
0.433, 0.348, 0.432, 0.422, 0.417 (`benchmarks/learning_margins.py`). The demo's fact
warm-up and 900 updates on six copies reach 0.980 and 0.957 for seeds 0 and 1 (docs/demo.md).
The warm-up here leaves out the demo's fact lookups, to keep the test short."""


def _model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def _copy_probe(tokenizer: Any, names: tuple[str, ...], model: Any) -> float:
    name_ids = {tokenizer.encode(name)[0] for name in names}
    rows = copy_sequences(tokenizer.hf, names, 100, seed=99)  # not the warm-up's sequences
    sequences = [
        TokenSequence(
            tuple(ids[: mask.index(1)]), tuple(ids[mask.index(1) :]), tuple(mask[mask.index(1) :])
        )  # fmt: skip
        for ids, mask in rows
    ]
    correct, total = name_token_accuracy(model, sequences, name_ids)
    return correct / total


@pytest.mark.slow
def test_the_demo_model_copies_held_out_names_after_warm_up_and_sft(
    tmp_path: Path, learning_seed: int, record_property: Any
) -> None:
    """The untrained model copies nothing; after the warm-up it repeats listed names; after a
    short SFT on the imperfect teacher's data it writes the names of test questions (entities
    no SFT question starts from) into queries, memories and answers, teacher-forced."""
    world = generate_world(replace(DEMO.world, seed=learning_seed))
    paths = write_world(world, tmp_path / "world")
    index = build_bm25(paths["corpus"], tmp_path / "index")
    model = save_demo_model(
        tmp_path / "model", tokenizer_texts(world), DEMO.model, learning_seed, world.names
    )
    tokenizer = load_tokenizer(str(model))
    assert _copy_probe(tokenizer, world.names, _model(model)) < 0.05

    renamed = [rename_world(world, copy) for copy in range(2)]  # as the demo, with fewer copies
    lookups = [question_lookups(renamed)]
    warm_up_copying(model, world.names, DEMO.copy_warmup_steps, seed=learning_seed, lookups=lookups)
    warmed = _copy_probe(tokenizer, world.names, _model(model))
    record_property("warm_up", round(warmed, 4))
    assert warmed > WARM_UP_THRESHOLD

    templates = Templates(**DEMO_TEMPLATES)
    data = tmp_path / "teacher.jsonl"
    with data.open("w", encoding="utf-8") as lines:
        for copy, copy_world in enumerate(renamed):  # the teacher on the renamed copies
            files = write_world(copy_world, tmp_path / f"copy-{copy}")
            train = read_examples(files["train"])
            teacher = ScriptedLLM(
                tokenizer, oracle_policy(train, replace(DEMO.flaws, seed=learning_seed))
            )
            episodes = start_episodes("memsearcher", train, tokenizer, DEMO.agent, templates)
            copy_index = build_bm25(files["corpus"], tmp_path / f"copy-{copy}" / "index")
            for t in run_lockstep(episodes, teacher, copy_index, SamplingParams()):
                lines.write(json.dumps(t.to_dict()) + "\n")
    preset = replace(DEMO, sft_steps=SFT_STEPS)
    train_sft(sft_config(preset, data, model, tmp_path / "sft", learning_seed))

    test = read_examples(paths["test"])
    ideal = ScriptedLLM(tokenizer, oracle_policy(test))
    episodes = start_episodes("memsearcher", test, tokenizer, DEMO.agent, templates)
    probe = [s for t in run_lockstep(episodes, ideal, index, SamplingParams()) for s in t.sequences]
    name_ids = {tokenizer.encode(name)[0] for name in world.names}
    trained = _model(tmp_path / "sft" / f"step-{SFT_STEPS}" / "model")
    correct, total = name_token_accuracy(trained, probe, name_ids)
    record_property("sft", round(correct / total, 4))
    assert total > 1000
    assert correct / total > SFT_THRESHOLD


def test_a_warm_up_update_is_the_padded_hf_loss_in_length_buckets(tmp_path: Path) -> None:
    """`copy_update` (the SFT trainer's buckets, the output layer on replies only) gives the
    loss and gradient of HF's ``labels`` loss over the rows right-padded to one width, the
    warm-up's update before it, to float rounding, also when the rows span micro-batches."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quick = PRESETS["quick"]
    world = generate_world(quick.world)
    folder = save_demo_model(
        tmp_path / "model", tokenizer_texts(world), quick.model, 0, world.names
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    long = [(f"Fact in: {' '.join(world.names[:40])}", world.names[7])]  # as long as passages
    lookups = [question_lookups([world]), long]
    rows = copy_sequences(tokenizer, world.names, 12, seed=3, lookups=lookups)
    pad = tokenizer.pad_token_id
    width = max(len(ids) for ids, _ in rows)
    assert min(len(ids) for ids, _ in rows) < 0.8 * width  # some rows are mostly padding

    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
    attention = torch.arange(width)[None] < torch.tensor([len(i) for i, _ in rows])[:, None]
    labels = torch.tensor(
        [[t if m else -100 for t, m in zip(ids, mask, strict=True)] + [-100] * (width - len(ids))
         for ids, mask in rows]
    )  # fmt: skip
    naive = model(input_ids=input_ids, attention_mask=attention.long(), labels=labels).loss
    naive.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    sequences = [reply_sequence(ids, mask) for ids, mask in rows]
    loss = copy_update(model, sequences, range(len(rows)), pad, token_budget=4 * width)
    assert loss == pytest.approx(naive.item(), rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)


def test_copy_update_one_row_per_micro_batch_is_the_same_update(tmp_path: Path) -> None:
    """A budget of one row per micro-batch changes only the number of passes: every reply
    token still weighs 1 / (the update's reply tokens), not 1 / (its micro-batch's)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quick = PRESETS["quick"]
    world = generate_world(quick.world)
    folder = save_demo_model(tmp_path / "m", tokenizer_texts(world), quick.model, 0, world.names)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    long = [(f"Fact in: {' '.join(world.names[:40])}", world.names[7])]
    rows = copy_sequences(tokenizer, world.names, 8, 4, lookups=[question_lookups([world]), long])
    sequences = [reply_sequence(ids, mask) for ids, mask in rows]
    pad = tokenizer.pad_token_id
    whole = copy_update(model, sequences, range(8), pad)
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    apart = copy_update(model, sequences, range(8), pad, token_budget=1)
    assert apart == pytest.approx(whole, rel=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-6, msg=name)
