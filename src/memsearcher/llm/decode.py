"""Batched decoding with a KV cache, for the transformers backend.

Written out rather than calling transformers' ``generate`` for two reasons:

- ``generate`` keeps computing a row after it has ended, until the batch's longest row ends.
  Agent generations end anywhere from a dozen tokens to the budget, so most row-steps of a
  batch are wasted (62% for 16 MemSearcher actions of the embedded model at 256 new tokens,
  54% for their memory updates; ``benchmarks/rollout_stragglers.py``). Here a row leaves the
  batch as soon as it ends: its rows of the KV cache are dropped with the cache's own
  ``batch_select_indices`` (1.6x and 1.5x the tokens/s of ``generate`` there, on a CPU).
- ``generate`` fills every sampling field a config leaves unset from the checkpoint's
  ``generation_config`` (Qwen2.5-Instruct: repetition penalty 1.05, top_k 20). Here the next
  token is drawn from exactly softmax(logits / T) within the top-p nucleus (`sample_next`),
  the distribution the trainer's log-probs model.

With ``share_prefix``, the tokens every prompt of the batch starts with (the system prompt, most
of an agent's action prompt) are computed once and their KV cache repeated for every row, as
the learner does (`memsearcher.rl.batching`); each row's own tokens follow at their own
positions, so the logits are those of the whole prompts to float rounding.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from memsearcher.llm.base import SamplingParams

__all__ = ["decode", "sample_next"]


def sample_next(
    logits: torch.Tensor,
    temperature: float,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """(A, V) logits -> (A,) next tokens: the argmax at temperature 0, else a draw from
    softmax(logits / temperature) restricted to the smallest set of most likely tokens whose
    mass reaches ``top_p`` (as vLLM and transformers' top-p)."""
    if temperature == 0:
        return logits.argmax(dim=-1)  # (A,)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (A, V)
    if top_p < 1.0:
        ranked, order = probs.sort(dim=-1, descending=True)  # (A, V)
        # a token is outside the nucleus when the more likely ones already reach top_p
        outside = ranked.cumsum(dim=-1) - ranked >= top_p  # (A, V)
        probs = torch.zeros_like(probs).scatter(-1, order, ranked.masked_fill(outside, 0.0))
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (A,)


@torch.no_grad()
def decode(
    model: Any,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    eos_ids: Collection[int],
    pad_id: int,
    stopped: Callable[[list[int]], bool],
    share_prefix: bool = False,
) -> list[list[int]]:
    """The tokens generated for each prompt (one left-padded batch): each row ends with an EOS
    token, with the token after which ``stopped(tokens)`` holds, or at ``max_new_tokens``."""
    from transformers import DynamicCache

    device = model.device
    if any(len(p) == 0 for p in prompts):
        raise ValueError("cannot generate from an empty prompt")
    generator = None
    if params.seed is not None:
        generator = torch.Generator(device=device).manual_seed(params.seed)
    kv = DynamicCache(config=model.config)
    cache = {_cache_argument(model): kv}
    shared = _shared_length(prompts) if share_prefix else 0
    if shared:  # the shared prefix once, its cache repeated for every row
        prefix = torch.tensor([list(prompts[0][:shared])], device=device)
        model(input_ids=prefix, use_cache=True, **cache, logits_to_keep=1)
        kv.batch_repeat_interleave(len(prompts))
    width = max(len(p) for p in prompts) - shared
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), shared + width), dtype=torch.long)
    attention_mask[:, :shared] = 1
    for row, prompt in enumerate(prompts):
        own = list(prompt[shared:])
        input_ids[row, width - len(own) :] = torch.tensor(own)
        attention_mask[row, shared + width - len(own) :] = 1
    # positions as transformers' generate counts them under left padding
    positions = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)[:, shared:]  # (B, L)
    attention_mask = attention_mask.to(device)
    last = positions[:, -1].to(device)  # (A,)
    output = model(
        input_ids=input_ids.to(device),
        attention_mask=attention_mask,
        position_ids=positions.to(device),
        use_cache=True,
        **cache,
        logits_to_keep=1,
    )
    rows = list(range(len(prompts)))  # which prompt each row of the running batch is
    generated: list[list[int]] = [[] for _ in prompts]
    for _ in range(params.max_new_tokens):
        tokens = sample_next(output.logits[:, -1, :], params.temperature, params.top_p, generator)
        keep = []
        for j, (row, token) in enumerate(zip(rows, tokens.tolist(), strict=True)):
            out = generated[row]
            out.append(token)
            if token not in eos_ids and len(out) < params.max_new_tokens and not stopped(out):
                keep.append(j)
        if not keep:
            break
        if len(keep) < len(rows):  # ended rows leave the batch and the cache
            index = torch.tensor(keep, device=device)
            kv.batch_select_indices(index)
            attention_mask, last, tokens = attention_mask[index], last[index], tokens[index]
            rows = [rows[j] for j in keep]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(rows), 1))], 1)
        last = last + 1
        output = model(
            input_ids=tokens[:, None],
            attention_mask=attention_mask,
            position_ids=last[:, None],
            use_cache=True,
            **cache,
        )
    return generated


SHARED_MINIMUM = 16
"""Fewer shared tokens than this are not worth a forward pass of their own."""


def _shared_length(prompts: Sequence[Sequence[int]]) -> int:
    """How many leading tokens all ``prompts`` share, short of the shortest one's last token
    (whose logits start its generation); 0 below `SHARED_MINIMUM` or for a single prompt."""
    if len(prompts) < 2:
        return 0
    limit = min(len(p) for p in prompts) - 1
    first = prompts[0]
    length = 0
    while length < limit and all(p[length] == first[length] for p in prompts):
        length += 1
    return length if length >= SHARED_MINIMUM else 0


def _cache_argument(model: Any) -> str:
    """The forward argument that takes the KV cache: ``cache`` from transformers 5.2x on,
    ``past_key_values`` before (deprecated since)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
