"""The packed-trajectory learner: one sequence per trajectory, exactly equal to its turns.

A trajectory of K turn sequences repeats the same start (system message, question) K times.
Packed, that shared prefix appears once, then each turn's own part follows as a segment: the
rest of its prompt (MemSearcher: the memory; MEM1: the previous response and observation),
then its response. A block mask lets each segment see only the prefix and itself, causally,
and positions restart after the prefix in every segment, so every token is computed with
exactly the context and position it had in its own turn: packed log-probs equal per-turn ones.

This is what MEM1's release (MIT-MI/MEM1, ``attn_mask_utils.py``) sets out to do, and gets
wrong three ways (docs/mem1.md): its 2-D mask goes to the model as 0/1 in bf16, which the model
adds to the scores, so nothing is masked; an internal state cannot see the previous internal
state it was conditioned on; and positions run on through the whole trajectory.

The mask comes in the form the model's attention implementation takes (`MASK_KINDS`):

- ``bool``: (B, 1, L, L), True where attention is allowed; ``sdpa``.
- ``additive``: (B, 1, L, L) float, 0 where allowed and the dtype's minimum elsewhere; ``eager``
  and ``sdpa``.
- ``flex``: a ``BlockMask`` of ``torch.nn.attention.flex_attention``; ``flex_attention``.

A mask of the wrong kind for the implementation is refused: ``eager`` adds whatever it is
given to the scores, so a boolean or 0/1 mask there would silently mask nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from memsearcher.errors import MemSearcherError
from memsearcher.rl.batching import MicroBatch, collate, laid_out, logits_at
from memsearcher.rl.distributed import unwrap
from memsearcher.rl.loss import token_logprobs
from memsearcher.types import TokenSequence

__all__ = [
    "ATTENTION_MASKS",
    "MASK_KINDS",
    "PackedBatch",
    "PackedMicroBatch",
    "PackedTrajectory",
    "collate_packed",
    "collate_trajectories",
    "mask_kind_of",
    "pack",
    "packed_logprobs",
    "packed_sequence_logprobs",
    "shared_prefix",
]

PAD_SEGMENT = -1
"""Segment id of padding; the prefix is segment 0, turn k is segment k + 1."""


@dataclass(frozen=True)
class PackedTrajectory:
    """One trajectory's turn sequences as one packed sequence of length L."""

    input_ids: tuple[int, ...]
    position_ids: tuple[int, ...]
    segment_ids: tuple[int, ...]
    """0 for the shared prefix, k + 1 for turn k's segment."""
    prefix: int
    """Length of the shared prefix."""
    response_starts: tuple[int, ...]
    """Packed index of each turn's first response token."""
    sequences: tuple[TokenSequence, ...]
    """The turn sequences packed here, in order."""

    def sources(self) -> list[int]:
        """For each response token of each turn in order, the packed index whose logits
        predict it: the token before it in its own turn (the prefix's last token for a
        segment that starts with its response)."""
        out = []
        for k, (start, sequence) in enumerate(
            zip(self.response_starts, self.sequences, strict=True)
        ):
            for j in range(start, start + len(sequence.response_ids)):
                same_segment = j - 1 >= 0 and self.segment_ids[j - 1] == k + 1
                out.append(j - 1 if same_segment else self.prefix - 1)
        return out


def shared_prefix(sequences: Sequence[TokenSequence]) -> int:
    """Length of the longest prefix that every turn's prompt starts with."""
    prompts = [s.prompt_ids for s in sequences]
    shortest = min(len(p) for p in prompts)
    n = 0
    while n < shortest and all(p[n] == prompts[0][n] for p in prompts):
        n += 1
    return n


def pack(sequences: Sequence[TokenSequence]) -> PackedTrajectory:
    """The turn sequences of one trajectory as one packed sequence."""
    if not sequences:
        raise ValueError("a trajectory needs at least one turn sequence")
    prefix = shared_prefix(sequences)
    if prefix == 0:
        raise ValueError("the turns share no prompt prefix: nothing to pack them on")
    ids = list(sequences[0].prompt_ids[:prefix])
    positions = list(range(prefix))
    segments = [0] * prefix
    starts = []
    for k, sequence in enumerate(sequences):
        suffix = sequence.input_ids[prefix:]
        starts.append(len(ids) + len(sequence.prompt_ids) - prefix)
        ids += suffix
        positions += range(prefix, prefix + len(suffix))
        segments += [k + 1] * len(suffix)
    return PackedTrajectory(
        tuple(ids), tuple(positions), tuple(segments), prefix, tuple(starts), tuple(sequences)
    )


@dataclass(frozen=True)
class PackedBatch:
    """B packed trajectories, right-padded to width L, with their attention mask."""

    packs: tuple[PackedTrajectory, ...]
    input_ids: torch.Tensor  # (B, L)
    position_ids: torch.Tensor  # (B, L)
    segment_ids: torch.Tensor  # (B, L), PAD_SEGMENT on padding
    attention_mask: Any  # (B, 1, L, L) tensor, or a BlockMask
    rows: torch.Tensor  # (N,): the row of each trained (loss mask 1) target
    sources: torch.Tensor  # (N,): the position whose logits predict it
    targets: torch.Tensor  # (N,): its token id

    @property
    def real_tokens(self) -> int:
        return int((self.segment_ids != PAD_SEGMENT).sum().item())

    @property
    def padded_tokens(self) -> int:
        return int(self.segment_ids.numel())


def allowed(segment_ids: torch.Tensor) -> torch.Tensor:
    """(B, L) -> (B, 1, L, L) bool: query q may attend key k iff k <= q and k is in the prefix
    or in q's own segment. A padding query attends only to itself, so no row is empty."""
    length = segment_ids.shape[1]
    q_seg = segment_ids[:, :, None]  # (B, L, 1)
    k_seg = segment_ids[:, None, :]  # (B, 1, L)
    causal = torch.ones(length, length, dtype=torch.bool).tril()  # (L, L)
    visible = (k_seg == 0) | (k_seg == q_seg)  # (B, L, L)
    real = (q_seg != PAD_SEGMENT) & (k_seg != PAD_SEGMENT)
    diagonal = torch.eye(length, dtype=torch.bool)
    return ((causal & visible & real) | diagonal)[:, None]  # (B, 1, L, L)


def _bool_mask(segment_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return allowed(segment_ids)


def _additive_mask(segment_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # the dtype's minimum rather than -inf: a fully masked row then stays finite
    blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype)
    return torch.where(allowed(segment_ids), torch.tensor(0.0, dtype=dtype), blocked)


def _flex_mask(segment_ids: torch.Tensor, dtype: torch.dtype) -> Any:
    from torch.nn.attention.flex_attention import create_block_mask

    segments = segment_ids

    def mask_mod(b: Any, h: Any, q: Any, kv: Any) -> Any:
        q_seg, k_seg = segments[b, q], segments[b, kv]
        keep = (kv <= q) & ((k_seg == 0) | (k_seg == q_seg)) & (q_seg != PAD_SEGMENT)
        return keep | (q == kv)

    batch, length = segment_ids.shape
    return create_block_mask(mask_mod, batch, None, length, length, device=segment_ids.device)


@dataclass(frozen=True)
class MaskKind:
    build: Callable[[torch.Tensor, torch.dtype], Any]
    """(segment_ids (B, L), model dtype) -> the mask."""
    backends: frozenset[str]
    """The ``config._attn_implementation`` values that read this mask correctly."""


MASK_KINDS: dict[str, MaskKind] = {
    "bool": MaskKind(_bool_mask, frozenset({"sdpa"})),
    "additive": MaskKind(_additive_mask, frozenset({"eager", "sdpa"})),
    "flex": MaskKind(_flex_mask, frozenset({"flex_attention"})),
}


def collate_packed(
    packs: Sequence[PackedTrajectory],
    pad_id: int,
    kind: str = "bool",
    dtype: torch.dtype = torch.float32,
) -> PackedBatch:
    """Packed trajectories as one right-padded batch with a ``kind`` mask (`MASK_KINDS`)."""
    if kind not in MASK_KINDS:
        raise MemSearcherError(f"unknown mask kind {kind!r}; choose one of {sorted(MASK_KINDS)}")
    width = max(len(p.input_ids) for p in packs)
    input_ids = torch.full((len(packs), width), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(packs), width), dtype=torch.long)
    segment_ids = torch.full((len(packs), width), PAD_SEGMENT, dtype=torch.long)
    rows, sources, targets = [], [], []
    for row, packed in enumerate(packs):
        n = len(packed.input_ids)
        input_ids[row, :n] = torch.tensor(packed.input_ids)
        position_ids[row, :n] = torch.tensor(packed.position_ids)
        segment_ids[row, :n] = torch.tensor(packed.segment_ids)
        source = iter(packed.sources())
        for sequence in packed.sequences:
            for token, trained in zip(sequence.response_ids, sequence.loss_mask, strict=True):
                j = next(source)
                if trained:
                    rows.append(row)
                    sources.append(j)
                    targets.append(token)
    return PackedBatch(
        packs=tuple(packs),
        input_ids=input_ids,
        position_ids=position_ids,
        segment_ids=segment_ids,
        attention_mask=MASK_KINDS[kind].build(segment_ids, dtype),
        rows=torch.tensor(rows, dtype=torch.long),
        sources=torch.tensor(sources, dtype=torch.long),
        targets=torch.tensor(targets, dtype=torch.long),
    )


def check_backend(model: Any, kind: str) -> None:
    """Refuse a mask the model's attention implementation would misread."""
    backend = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if kind in MASK_KINDS and backend not in MASK_KINDS[kind].backends:
        raise MemSearcherError(
            f"a {kind!r} mask needs attention {sorted(MASK_KINDS[kind].backends)}, but the model "
            f"uses {backend!r}; load it with attn_implementation=... or choose another kind"
        )


def packed_logprobs(
    model: Any,
    batch: PackedBatch,
    temperature: float = 1.0,
    autocast: str | None = None,
    kind: str | None = None,
) -> list[torch.Tensor]:
    """Per turn sequence (trajectory by trajectory, in order), the (len(response),) log-probs
    of its response tokens, 0 where the loss mask is 0, from one forward pass over the packed
    batch. Gradients flow when called outside ``torch.no_grad``. ``kind`` (the mask's kind) is
    checked against the model's attention implementation when given."""
    if kind is not None:
        check_backend(model, kind)
    device = next(model.parameters()).device
    rows, sources = batch.rows.to(device), batch.sources.to(device)
    mask = batch.attention_mask
    logits = logits_at(
        model,
        rows,
        sources,
        autocast,
        input_ids=batch.input_ids.to(device),
        position_ids=batch.position_ids.to(device),
        attention_mask=mask.to(device) if isinstance(mask, torch.Tensor) else mask,
    )  # (1, N, V)
    picked = token_logprobs(logits, batch.targets.to(device)[None], temperature)[0]  # (N,)
    out, n = [], 0
    for packed in batch.packs:
        for sequence in packed.sequences:
            trained = torch.tensor(sequence.loss_mask, dtype=torch.bool, device=device)
            values = picked.new_zeros(len(sequence.response_ids))
            count = int(trained.sum())
            out.append(values.masked_scatter(trained, picked[n : n + count]))
            n += count
    return out


ATTENTION_MASKS = {"sdpa": "bool", "eager": "additive", "flex_attention": "flex"}
"""The mask kind the packed learner builds for each attention implementation; the others
(flash attention) take no 2-D mask."""


def mask_kind_of(model: Any) -> str:
    """The mask kind for ``model``'s attention implementation (`ATTENTION_MASKS`)."""
    backend = getattr(getattr(unwrap(model), "config", None), "_attn_implementation", None)
    if backend not in ATTENTION_MASKS:
        raise MemSearcherError(
            f"learner: packed needs a 2-D attention mask, which attention {backend!r} cannot "
            f"take; load the model with one of {sorted(ATTENTION_MASKS)}, or use learner: "
            "per-turn"
        )
    return ATTENTION_MASKS[backend]


@dataclass(frozen=True, kw_only=True)
class PackedMicroBatch(MicroBatch):
    """Whole trajectories, computed packed. The forward pass reads ``packed``; the loss reads
    the per-turn fields (``indices`` in pack order, ``targets``, ``loss_mask``) as it does for
    any micro-batch, so advantages, ratios and weights are those of the per-turn learner."""

    packed: PackedBatch

    @property
    def real_tokens(self) -> int:
        return self.packed.real_tokens

    @property
    def padded_tokens(self) -> int:
        return self.packed.padded_tokens


def collate_trajectories(
    sequences: Sequence[TokenSequence], trajectories: Sequence[Sequence[int]],
    packs: Sequence[PackedTrajectory], pad_id: int, kind: str,
) -> PackedMicroBatch:  # fmt: skip
    """The trajectories (each the indices of its turn sequences, in order; ``packs``, each one
    `pack`ed) as one packed micro-batch with a ``kind`` mask."""
    turns = collate(sequences, [i for t in trajectories for i in t], pad_id)
    layout = {f.name: getattr(turns, f.name) for f in fields(MicroBatch)}
    return PackedMicroBatch(**layout, packed=collate_packed(packs, pad_id, kind))


def packed_sequence_logprobs(
    model: Any,
    batch: PackedMicroBatch,
    temperature: float = 1.0,
    compute: str | None = None,
    entropy: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """`batching.sequence_logprobs` of a packed micro-batch: the same (B, R) log-probs (and
    entropies), from one forward pass over its packed rows."""
    device = next(model.parameters()).device
    packed = batch.packed
    # the loss-mask-1 cells, row by row: the order of packed.targets (sequences in pack order)
    rows, cols = batch.loss_mask.bool().nonzero(as_tuple=True)  # (N,), (N,)
    mask = packed.attention_mask
    logits = logits_at(
        model,
        packed.rows.to(device),
        packed.sources.to(device),
        compute,
        input_ids=packed.input_ids.to(device),
        position_ids=packed.position_ids.to(device),
        attention_mask=mask.to(device) if isinstance(mask, torch.Tensor) else mask,
    )  # (1, N, V)
    return laid_out(logits, batch, rows.to(device), cols.to(device), temperature, entropy)
