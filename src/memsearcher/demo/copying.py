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
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from memsearcher.agent.prompts import format_hits
from memsearcher.data.synthetic import World
from memsearcher.rl.batching import micro_batches, sequence_logprobs
from memsearcher.rl.config import OptimConfig
from memsearcher.rl.optim import make_optimizer, make_scheduler, optimizer_step
from memsearcher.types import TokenSequence

__all__ = [
    "copy_sequences",
    "copy_update",
    "fact_lookups",
    "name_token_accuracy",
    "question_lookups",
    "reply_sequence",
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
    ``names`` and ``lookups`` and save it back; returns the loss of each update.

    Each update is the SFT trainer's (`copy_update`, then `optimizer_step`): AdamW, clipping at
    1, the learning rate decaying from ``lr`` to 0 on a cosine.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train()
    optim = OptimConfig(lr=lr, schedule="cosine")
    optimizer = make_optimizer(model, optim)
    scheduler = make_scheduler(optimizer, optim, steps)
    rows = copy_sequences(tokenizer, names, steps * batch, seed, lookups=lookups)
    sequences = [reply_sequence(ids, mask) for ids, mask in rows]
    losses = []
    for step in range(steps):
        chosen = range(step * batch, (step + 1) * batch)
        losses.append(copy_update(model, sequences, chosen, tokenizer.pad_token_id))
        optimizer_step(model, optimizer, scheduler, optim)
    model.save_pretrained(folder)
    return losses


def reply_sequence(ids: Sequence[int], mask: Sequence[int]) -> TokenSequence:
    """A `copy_sequences` row as a turn sequence: the prompt up to the reply, the reply
    trained."""
    start = list(mask).index(1)
    return TokenSequence(tuple(ids[:start]), tuple(ids[start:]), tuple(mask[start:]))


def copy_update(
    model: Any,
    sequences: Sequence[TokenSequence],
    chosen: Iterable[int],
    pad_id: int,
    token_budget: int = 16384,
) -> float:
    """Backpropagate the mean negative log-likelihood of the reply tokens of ``chosen``, as
    the SFT trainer does (length buckets of at most ``token_budget`` padded tokens, the output
    layer on reply tokens only); returns that mean.

    The same loss as HF's ``labels`` loss over the rows padded to one width, which the warm-up
    used before: that padded the short name rows to the longest fact row (2.2x the tokens) and
    computed (V,)-wide logits at every position (`benchmarks/sft_step.py`).
    """
    lengths = [len(s.input_ids) for s in sequences]
    batches = micro_batches(sequences, lengths, [list(chosen)], token_budget, pad_id)
    tokens = sum(float(b.loss_mask.sum()) for b in batches)
    nll = 0.0
    for batch in batches:
        logprobs = sequence_logprobs(model, batch)  # (B, R)
        loss = -(logprobs * batch.loss_mask).sum() / tokens
        loss.backward()
        nll += float(loss.detach())
    return nll


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
