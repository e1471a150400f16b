"""Copying names: the demo model's warm-up on copy sequences, and the probe that measures it.

A model trained from nothing must learn to write a name it has only read (the question's
entity into the first query, a passage's answer into the next query and the memory). Measured
in docs/demo.md: without help a 1M-parameter model learns which kind of name goes where, not
which one, within the demo's budget. The warm-up trains the copy behaviour directly, on chat
turns whose reply repeats the names of the user message, names a question's entity, or copies
a hop's fact out of retrieved passages (unless `DemoConfig.fact_warmup` is off), before any
protocol data; the probe is the teacher-forced accuracy on name tokens of held-out
trajectories.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from memsearcher.agent.prompts import format_hits
from memsearcher.data.synthetic import World
from memsearcher.types import TokenSequence

__all__ = [
    "copy_sequences",
    "fact_lookups",
    "name_token_accuracy",
    "question_lookups",
    "warm_up_copying",
]


def copy_sequences(
    tokenizer: Any,
    names: Sequence[str],
    count: int,
    seed: int,
    longest: int = 3,
    lookups: Sequence[Sequence[tuple[str, str]]] = (),
) -> list[tuple[list[int], list[int]]]:
    """``count`` chat turns (ids, loss mask) whose reply copies names from the user message;
    the loss covers the reply. Each turn is, with equal chance, a list of 1 to ``longest`` of
    ``names`` that the reply repeats in order, or a (message, reply) pair of one of the
    ``lookups`` kinds (`question_lookups`, `fact_lookups`)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        kind = int(rng.random() * (1 + len(lookups))) if lookups else 0
        if kind < len(lookups):
            message, reply = rng.choice(lookups[kind])
        else:
            listed = " ".join(rng.choices(names, k=rng.randint(1, longest)))
            message, reply = f"Repeat: {listed}", listed
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        reply_ids = tokenizer.encode(f"{reply}<|im_end|>\n", add_special_tokens=False)
        out.append((prompt_ids + reply_ids, [0] * len(prompt_ids) + [1] * len(reply_ids)))
    return out


def question_lookups(worlds: Sequence[World]) -> list[tuple[str, str]]:
    """A train question of ``worlds`` and its entity: copying a name out of a question is the
    first thing every episode does."""
    return [(f"Name in: {q.question}", q.hops[0].entity) for w in worlds for q in w.split("train")]


def fact_lookups(world: World, index: Any, top_n: int) -> list[tuple[str, str]]:
    """For every hop of ``world``'s train questions, the passages ``index`` returns for the
    hop's entity (as the agent reads them) and the start of the hop's fact sentence; the reply
    is the whole sentence. The passages hold other sentences about the same entity and its
    neighbours (its employees' birthplaces, its author's other works), so the object must be
    found by the subject and the relation, as a memory update must find it."""
    hops = {hop for q in world.split("train") for hop in q.hops}
    lookups = []
    for hop in sorted(hops, key=lambda h: (h.entity, h.relation)):
        passages = format_hits(index.search([hop.entity], top_n)[0])
        if hop.fact in passages:
            start = hop.fact[: hop.fact.rindex(hop.target)].rstrip()
            lookups.append((f"Fact in:\n{passages}\n{start}", hop.fact))
    return lookups


def warm_up_copying(
    folder: str | Path,
    names: Sequence[str],
    steps: int,
    seed: int,
    batch: int = 32,
    lr: float = 1e-3,
    lookups: Sequence[Sequence[tuple[str, str]]] = (),
) -> list[float]:
    """Train the model saved in ``folder`` for ``steps`` updates on `copy_sequences` of
    ``names`` and ``lookups`` and save it back; returns the loss of each update."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    data = copy_sequences(tokenizer, names, steps * batch, seed, lookups=lookups)
    losses = []
    for step in range(steps):
        rows = data[step * batch : (step + 1) * batch]
        width = max(len(ids) for ids, _ in rows)
        pad = tokenizer.pad_token_id
        input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
        attention = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
        labels = torch.tensor(
            [
                [t if m else -100 for t, m in zip(ids, mask, strict=True)]
                + [-100] * (width - len(ids))
                for ids, mask in rows
            ]
        )
        # cosine decay from lr to 0 over the warm-up
        for group in optimizer.param_groups:
            group["lr"] = lr * 0.5 * (1 + torch.cos(torch.tensor(step / steps * torch.pi)).item())
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    model.save_pretrained(folder)
    return losses


@torch.no_grad()
def name_token_accuracy(
    model: Any, sequences: Sequence[TokenSequence], name_ids: set[int]
) -> tuple[int, int]:
    """Teacher-forced copy probe: of the trained tokens (loss mask 1) that are name tokens,
    how many the model predicts as its top token. Returns (correct, total)."""
    model.eval()
    correct = total = 0
    for sequence in sequences:
        start = len(sequence.prompt_ids)
        ids = torch.tensor([[*sequence.prompt_ids, *sequence.response_ids]])
        predicted = model(input_ids=ids).logits[0, start - 1 : -1].argmax(-1).tolist()
        targets = zip(sequence.response_ids, sequence.loss_mask, strict=True)
        for k, (target, trained) in enumerate(targets):
            if trained and target in name_ids:
                total += 1
                correct += predicted[k] == target
    return correct, total
