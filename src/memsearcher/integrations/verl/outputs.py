"""A finished trajectory as veRL's per-turn rows: pure functions, no veRL import.

Each ``TokenSequence`` of the trajectory becomes one row (the fields of veRL's
``AgentLoopOutput``): a MemSearcher trajectory of N turns gives N rows, a ReAct trajectory one.
Prompt ids, response ids and the loss mask are the episode's own, unchanged: the same tokens
our trainer trains on. Rollout log-probs, when the server returned them, are laid on the mask-1
positions in generation order (0.0 under mask 0), and the graded reward with its metrics goes on
the last row, which is where veRL looks for it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from memsearcher.errors import MemSearcherError
from memsearcher.eval.metrics import exact_match, f1_score, objective_sum
from memsearcher.llm.base import Tokenizer
from memsearcher.types import FinishReason, Trajectory

__all__ = ["finish_reason", "lay_logprobs", "reward_info", "turn_rows"]


def finish_reason(
    token_ids: Sequence[int], stop: Sequence[str], tokenizer: Tokenizer
) -> FinishReason:
    """Why a server generation ended, as our episodes need it.

    veRL's vLLM server reports ``completed`` both for a stop and for a cut at ``max_tokens``, so
    the reason is read from the tokens, as our HF backend does: an end-of-sequence token or a
    stop string in the text is a stop; anything else ran out of budget.
    """
    if token_ids and token_ids[-1] in tokenizer.eos_token_ids:
        return "stop"
    if stop and any(s in tokenizer.decode(token_ids) for s in stop):
        return "stop"
    return "length"


def lay_logprobs(
    trajectory: Trajectory, generations: Sequence[Sequence[float]]
) -> list[list[float]]:
    """Per row, the rollout log-prob of every response token: the generations' log-probs, in
    order, on the mask-1 positions; 0.0 where the environment wrote the token (mask 0).

    Every generated token is appended to the current sequence with mask 1 (``Episode.
    take_generation``), so the mask-1 positions of the rows, read in order, are exactly the
    generated tokens; an agent that broke this would misalign every ratio, hence the check.
    """
    flat = [float(lp) for generation in generations for lp in generation]
    rows: list[list[float]] = []
    taken = 0
    for sequence in trajectory.sequences:
        row = []
        for mask in sequence.loss_mask:
            if mask:
                if taken >= len(flat):
                    break
                row.append(flat[taken])
                taken += 1
            else:
                row.append(0.0)
        rows.append(row)
    generated = sum(sum(s.loss_mask) for s in trajectory.sequences)
    if generated != len(flat):
        raise MemSearcherError(
            f"{trajectory.agent} trajectory {trajectory.example.id!r}: its rows hold {generated} "
            f"generated tokens but the server returned log-probs for {len(flat)}"
        )
    return rows


def reward_info(trajectory: Trajectory, reward: float) -> dict[str, Any]:
    """veRL's ``reward_extra_info``: numbers it averages per data source in validation
    (``acc`` is its headline), ``pred`` for its majority vote, strings it only logs.

    A composed multi-objective task sums ``acc`` and ``f1`` over its objectives with the count
    rule, as our evaluation does (0..N)."""
    answer = trajectory.answer if trajectory.well_formed and trajectory.answer else ""
    example, turns = trajectory.example, trajectory.turns
    if "objectives" in example.metadata:
        acc = objective_sum(answer, example.objectives, exact_match) if answer else 0.0
        f1 = objective_sum(answer, example.objectives, f1_score) if answer else 0.0
    else:
        acc = exact_match(answer, example.golden_answers) if answer else 0.0
        f1 = f1_score(answer, example.golden_answers) if answer else 0.0
    return {
        "score": float(reward),
        "acc": acc,
        "f1": f1,
        "well_formed": float(trajectory.well_formed),
        "turns": float(len(turns)),
        "searches": float(trajectory.num_searches),
        "prompt_tokens": sum(t.prompt_tokens for t in turns) / len(turns) if turns else 0.0,
        "generated_tokens": float(sum(t.generated_tokens for t in turns)),
        "end_reason": trajectory.end_reason,
        "pred": answer,
    }


def turn_rows(
    trajectory: Trajectory,
    generations: Sequence[Sequence[float]] | None,
    reward: Callable[[Trajectory], float],
    extra: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """The keyword arguments of one ``AgentLoopOutput`` per training sequence of
    ``trajectory`` (``metrics`` excepted, which the loop adds).

    ``generations``: the log-probs of each generation call in order, or None when the server
    returned none. ``extra`` is merged into every row's ``extra_fields`` (veRL's own keys such
    as ``min_global_steps``).
    """
    if not trajectory.sequences:
        raise MemSearcherError(
            f"{trajectory.agent} trajectory {trajectory.example.id!r} ended before the model "
            f"generated anything ({trajectory.end_reason}: {trajectory.error}); veRL needs at "
            "least one row per trajectory: raise rollout.max_model_len or shorten the prompt"
        )
    logprobs = lay_logprobs(trajectory, generations) if generations is not None else None
    score = reward(trajectory)
    summary = {
        "agent": trajectory.agent,
        "rows": len(trajectory.sequences),
        "turns": len(trajectory.turns),
        "searches": trajectory.num_searches,
        "prompt_tokens": [t.prompt_tokens for t in trajectory.turns],
        "end_reason": trajectory.end_reason,
    }
    rows = []
    for k, sequence in enumerate(trajectory.sequences):
        row: dict[str, Any] = {
            "prompt_ids": list(sequence.prompt_ids),
            "response_ids": list(sequence.response_ids),
            "response_mask": list(sequence.loss_mask),
            "num_turns": len(trajectory.turns),
            "extra_fields": {**(extra or {}), "memsearcher": {**summary, "row": k}},
        }
        if logprobs is not None:
            row["response_logprobs"] = logprobs[k]
        rows.append(row)
    rows[-1]["reward_score"] = score
    rows[-1]["extra_fields"]["reward_extra_info"] = reward_info(trajectory, score)
    return rows
