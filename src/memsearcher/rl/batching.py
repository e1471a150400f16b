"""Learner batches: turn sequences bucketed by length, and their per-token log-probabilities.

Sequences are sorted by length and cut into micro-batches under a budget of padded tokens, so
each micro-batch holds sequences of similar length and padding stays a small share of the
tokens processed (``benchmarks/learner.py`` measures it). Rows are left-padded, so every
response ends at the last position and one ``logits_to_keep`` slice covers all of them: the
logits (the biggest tensor by far, V per position) are computed for response positions only.

With ``share_prefix``, the tokens every row of a micro-batch starts with (the system prompt,
often more than half of a turn sequence) are computed once: one forward pass over that prefix
fills a KV cache, repeated for every row, and the rows' own tokens attend to it at their own
positions. Every token still sees exactly its own context, so the log-probs are those of the
rows computed whole, to float rounding (`tests/test_batching.py`), and the gradient flows back
through the shared cache into the prefix once.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from memsearcher.rl.distributed import unwrap
from memsearcher.rl.loss import token_logprobs
from memsearcher.rl.policy import autocast
from memsearcher.rl.ppo import entropy_from_logits
from memsearcher.types import TokenSequence

__all__ = [
    "MicroBatch",
    "blank_batch",
    "collate",
    "laid_out",
    "logits_at",
    "micro_batches",
    "padding_share",
    "plan_micro_batches",
    "response_logprobs",
    "right_aligned",
    "sequence_logprobs",
    "shared_prefix",
]


@dataclass(frozen=True)
class MicroBatch:
    """B left-padded sequences of width L; their responses in the last R positions."""

    indices: tuple[int, ...]
    """Which sequences of the caller's list these rows are."""
    input_ids: torch.Tensor  # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    position_ids: torch.Tensor  # (B, L)
    targets: torch.Tensor  # (B, R): the last R tokens of each row
    loss_mask: torch.Tensor  # (B, R): 1 on the row's generated response tokens, else 0
    prefix: int = 0
    """How many leading tokens every row shares and `sequence_logprobs` computes once (0: none);
    never more than the shortest prompt minus one, so every predicting position is a row's."""

    @property
    def real_tokens(self) -> int:
        """Tokens of the rows, the shared prefix counted once."""
        return int(self.attention_mask.sum().item()) - self.prefix * (len(self.indices) - 1)

    @property
    def padded_tokens(self) -> int:
        """Tokens a forward pass computes, padding included, the shared prefix once."""
        return int(self.attention_mask.numel()) - self.prefix * (len(self.indices) - 1)


def plan_micro_batches(
    lengths: Sequence[int],
    token_budget: int,
    units: Sequence[Sequence[int]] | None = None,
    max_row_padding: float = 0.1,
) -> list[list[int]]:
    """Sequence indices grouped into micro-batches of at most ``token_budget`` padded tokens.

    ``units`` are sets of sequences that must share a micro-batch (by default each sequence is
    its own unit); units are sorted by their longest sequence and packed greedily, longest
    first. A micro-batch is also closed before a unit whose longest sequence is more than
    ``max_row_padding`` shorter than the batch's width, so with single-sequence units no row
    is more than that share padding. A unit over the budget on its own still gets a
    micro-batch of its own.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    if units is None:
        units = [[i] for i in range(len(lengths))]
    order = sorted(units, key=lambda unit: max(lengths[i] for i in unit), reverse=True)
    plans: list[list[int]] = []
    current: list[int] = []
    width = 0
    for unit in order:
        unit_width = max(lengths[i] for i in unit)
        new_width = max(width, unit_width)
        too_short = unit_width < (1.0 - max_row_padding) * width
        if current and (too_short or (len(current) + len(unit)) * new_width > token_budget):
            plans.append(current)
            current, new_width = [], unit_width
        current += list(unit)
        width = new_width
    if current:
        plans.append(current)
    return plans


def micro_batches(
    sequences: Sequence[TokenSequence],
    lengths: Sequence[int],
    groups: Iterable[Sequence[int]],
    token_budget: int,
    pad_id: int,
    share_prefix: bool = False,
) -> list[MicroBatch]:
    """SFT's micro-batches: each of ``groups`` (indices into ``sequences``, whose lengths are
    ``lengths``) planned into length buckets of at most ``token_budget`` padded tokens
    (`plan_micro_batches`), each bucket collated."""
    plans = [
        plan
        for group in groups
        for plan in plan_micro_batches(lengths, token_budget, [[i] for i in group])
    ]
    return [collate(sequences, plan, pad_id, share_prefix) for plan in plans]


def collate(
    sequences: Sequence[TokenSequence],
    indices: Sequence[int],
    pad_id: int,
    share_prefix: bool = False,
) -> MicroBatch:
    """The sequences at ``indices`` as one left-padded micro-batch; with ``share_prefix``, its
    ``prefix`` is the length of the tokens all rows start with (`shared_prefix`)."""
    rows = [sequences[i] for i in indices]
    width = max(len(s.input_ids) for s in rows)
    span = max(len(s.response_ids) for s in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), span), dtype=torch.float32)
    for row, sequence in enumerate(rows):
        ids = sequence.input_ids
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
        if sequence.response_ids:
            loss_mask[row, span - len(sequence.response_ids) :] = torch.tensor(
                sequence.loss_mask, dtype=torch.float32
            )
    # As HF generate does for left padding, so that log-probs match the sampler's positions.
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return MicroBatch(
        indices=tuple(indices),
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        targets=input_ids[:, width - span :],
        loss_mask=loss_mask,
        prefix=shared_prefix(rows) if share_prefix and len(rows) > 1 else 0,
    )


def shared_prefix(rows: Sequence[TokenSequence], minimum: int = 16) -> int:
    """The number of leading tokens all ``rows`` share, at most the shortest prompt minus one
    (the last prompt token predicts the first response token, so it must be each row's own);
    0 when that is under ``minimum`` tokens, too few to pay for a second forward pass."""
    limit = min(len(row.prompt_ids) for row in rows) - 1
    first = rows[0].input_ids
    length = 0
    while length < limit and all(row.input_ids[length] == first[length] for row in rows):
        length += 1
    return length if length >= minimum else 0


def blank_batch(pad_id: int) -> MicroBatch:
    """One pad token with loss mask 0 and no sequence behind it: a forward and backward pass
    that adds nothing, for a rank that holds none of a mini-batch's sequences."""
    one = torch.ones((1, 1), dtype=torch.long)
    return MicroBatch(
        indices=(),
        input_ids=one * pad_id,
        attention_mask=one,
        position_ids=one * 0,
        targets=one * pad_id,
        loss_mask=torch.zeros((1, 1), dtype=torch.float32),
    )


def sequence_logprobs(
    model: Any,
    batch: MicroBatch,
    temperature: float = 1.0,
    compute: str | None = None,
    entropy: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """(B, R) log-probabilities of the last R tokens of each row under ``model``; 0 where the
    loss mask is 0.

    Only positions with loss mask 1 reach the output layer: a pre-hook on it keeps just their
    hidden states, so tool responses inside the response window (often most of a MemSearcher
    turn) cost no (V,)-wide logits. Gradients flow when called outside ``torch.no_grad``.
    ``compute`` (e.g. "bfloat16") runs the model's forward under autocast; the log-softmax is
    float32 either way. ``entropy``, when given, receives the (B, R) entropies of the same
    positions (PPO's entropy bonus), at the cost of one more pass over their logits.
    """
    device = next(model.parameters()).device
    span = batch.targets.shape[1]
    # window column c of the last span + 1 hidden states predicts target c
    rows, cols = batch.loss_mask.bool().nonzero(as_tuple=True)  # (N,), (N,)
    rows, cols = rows.to(device), cols.to(device)
    inputs = _prefixed(model, batch, compute) if batch.prefix else _whole(batch)
    logits = logits_at(
        model,
        rows,
        cols,
        compute,
        **{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()},
        logits_to_keep=span + 1,
    )  # (1, N, V)
    return laid_out(logits, batch, rows, cols, temperature, entropy)


def laid_out(
    logits: torch.Tensor,
    batch: MicroBatch,
    rows: torch.Tensor,
    cols: torch.Tensor,
    temperature: float,
    entropy: list[torch.Tensor] | None,
) -> torch.Tensor:
    """(B, R) log-probs of ``batch.targets`` at the cells (rows, cols) from their (1, N, V)
    logits, 0 elsewhere; ``entropy``, when given, receives the (B, R) entropies of the same."""
    targets = batch.targets.to(logits.device)[rows, cols][None]  # (1, N)
    picked = token_logprobs(logits, targets, temperature)[0]  # (N,)
    out = picked.new_zeros(batch.targets.shape)  # (B, R)
    if entropy is not None:  # of softmax(logits / T), as the log-probs, with its gradient
        per_token = entropy_from_logits(logits[0] / temperature)  # (N,)
        entropy.append(out.index_put((rows, cols), per_token.to(out.dtype)))
    return out.index_put((rows, cols), picked)


def _whole(batch: MicroBatch) -> dict[str, Any]:
    return {
        "input_ids": batch.input_ids,
        "attention_mask": batch.attention_mask,
        "position_ids": batch.position_ids,
    }


def _prefixed(model: Any, batch: MicroBatch, compute: str | None) -> dict[str, Any]:
    """The model inputs of ``batch`` past its shared prefix, with that prefix's KV cache
    (computed here, once, and repeated for every row) under the cache keyword of the model."""
    from transformers import DynamicCache

    device = next(model.parameters()).device
    width, prefix = batch.input_ids.shape[1], batch.prefix
    starts = width - batch.attention_mask.sum(dim=1)  # (B,): each row's first real column
    first = int(starts.min())
    prefix_ids = batch.input_ids[starts.argmin(), first : first + prefix][None]  # (1, P)
    cache = DynamicCache(config=unwrap(model).config)
    keyword = _cache_keyword(model)
    with autocast(compute, device):
        model(input_ids=prefix_ids.to(device), use_cache=True, logits_to_keep=1,
              **{keyword: cache})  # fmt: skip
    cache.batch_repeat_interleave(len(batch.indices))
    # the rows' own tokens: columns first + prefix .. width, each row's prefix copy masked out
    columns = torch.arange(first + prefix, width)  # (W,)
    own = (columns[None, :] >= (starts + prefix)[:, None]).long()  # (B, W)
    return {
        "input_ids": batch.input_ids[:, first + prefix :],
        "attention_mask": torch.cat([torch.ones(len(starts), prefix, dtype=own.dtype), own], 1),
        "position_ids": batch.position_ids[:, first + prefix :],  # as in the whole rows
        keyword: cache,
    }


def _cache_keyword(model: Any) -> str:
    """transformers 5 names the forward's KV cache ``cache``; 4.x, ``past_key_values``."""
    parameters = inspect.signature(unwrap(model).get_decoder().forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def logits_at(
    model: Any, rows: torch.Tensor, cols: torch.Tensor, compute: str | None, **inputs: Any
) -> torch.Tensor:
    """(1, N, V): the logits at hidden-state positions (rows[i], cols[i]) of one forward pass.

    A pre-hook on the output layer keeps just those hidden states, so no other position pays
    for (V,)-wide logits. ``cols`` index what reaches the output layer (with ``logits_to_keep``,
    its window). ``compute`` (e.g. "bfloat16") runs the forward under autocast in that dtype.
    """
    device = next(model.parameters()).device

    def keep(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return (args[0][rows, cols][None], *args[1:])  # (1, N, H)

    head = unwrap(model).get_output_embeddings()
    handle = head.register_forward_pre_hook(keep)
    try:
        with autocast(compute, device):
            output = model(**inputs, use_cache=False)
    finally:
        handle.remove()
    return output.logits


def padding_share(batches: Sequence[MicroBatch]) -> float:
    """Padding tokens / all tokens processed, over ``batches``."""
    padded = sum(b.padded_tokens for b in batches)
    return 0.0 if padded == 0 else 1.0 - sum(b.real_tokens for b in batches) / padded


@torch.no_grad()
def response_logprobs(
    model: Any,
    sequences: Sequence[TokenSequence],
    token_budget: int,
    pad_id: int,
    temperature: float = 1.0,
    compute: str | None = None,
    share_prefix: bool = False,
) -> list[torch.Tensor]:
    """Per sequence, the (len(response),) log-probs of its response tokens, on the CPU."""
    out: list[torch.Tensor] = [torch.empty(0)] * len(sequences)
    lengths = [len(s.input_ids) for s in sequences]
    for plan in plan_micro_batches(lengths, token_budget):
        batch = collate(sequences, plan, pad_id, share_prefix)
        logprobs = sequence_logprobs(model, batch, temperature, compute).float().cpu()  # (B, R)
        for row, index in enumerate(plan):
            out[index] = logprobs[row, logprobs.shape[1] - len(sequences[index].response_ids) :]
    return out


def right_aligned(values: Sequence[torch.Tensor], batch: MicroBatch) -> torch.Tensor:
    """(B, R): per-sequence response values laid out like ``batch.targets``."""
    span = batch.targets.shape[1]
    out = torch.zeros((len(batch.indices), span), dtype=torch.float32)
    for row, index in enumerate(batch.indices):
        value = values[index]
        out[row, span - value.numel() :] = value
    return out
