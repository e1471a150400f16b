"""Answer metrics: exact match, substring match ("acc") and token F1, as FlashRAG scores them.

The definitions follow FlashRAG's ``flashrag/evaluator/metrics.py`` and
``flashrag/evaluator/utils.py`` (``ExactMatch``, ``Sub_ExactMatch``, ``F1_Score``,
``normalize_answer``), which in turn reuse the SQuAD v1.1 official evaluation script and, for
the yes/no/noanswer rule, HotpotQA's ``hotpot_evaluate_v1.py``. Where FlashRAG and SQuAD
disagree we follow FlashRAG, so that our numbers are comparable with results scored by
FlashRAG:

- F1 when the prediction and the gold both normalize to the empty string: 0.0 here, as in
  FlashRAG and SQuAD v1.1 (SQuAD v2.0's ``compute_f1`` scores it 1.0). Exact match still
  scores that pair 1.0, so ``exact_match == 1`` does not imply ``f1_score == 1`` when the
  normalized prediction is empty.
- F1 with a yes/no/noanswer answer on either side that differs from the other side: 0.0 here
  (FlashRAG, from HotpotQA); SQuAD gives partial credit, e.g. "yes" against "yes sir" = 2/3.
- An empty list of gold answers raises ``ValueError`` here. FlashRAG silently scores 0.0 and
  SQuAD v1.1 fails inside ``max([])``; neither is a result worth averaging.

FlashRAG's regex mode (gold answers as patterns, used only for CuratedTREC) is not supported.

Multi-objective tasks (MEM1) are scored with the count rule of MEM1's evaluation
(MIT-MI/MEM1, ``inference/eval.py``): the answer is split on ";", scores 0 if it does not give
exactly N answers, else the per-position scores are summed (so the maximum is N). MEM1's
training reward (``verl/utils/reward_score/qa_multiple.py``) has no count rule, and its own
evaluation normalizes differently (punctuation to spaces, set-based F1); here each position is
scored by the functions above, so N = 1 agrees with the single-question metrics.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from memsearcher.text import normalize_answer

__all__ = [
    "exact_match",
    "f1_score",
    "normalize_answer",
    "objective_sum",
    "split_answers",
    "sub_exact_match",
]

# HotpotQA's special answers: a mismatch involving one of them earns no partial credit.
_SPECIAL_ANSWERS = frozenset({"yes", "no", "noanswer"})


def _as_gold_list(golden_answers: str | Sequence[str]) -> Sequence[str]:
    # A bare string is one answer, not a sequence of one-character answers.
    golds = [golden_answers] if isinstance(golden_answers, str) else golden_answers
    if len(golds) == 0:
        raise ValueError("golden_answers is empty: a question needs at least one gold answer")
    return golds


def exact_match(prediction: str, golden_answers: str | Sequence[str]) -> float:
    """1.0 if the normalized prediction equals any normalized gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(gold) == pred for gold in _as_gold_list(golden_answers)))


def sub_exact_match(prediction: str, golden_answers: str | Sequence[str]) -> float:
    """FlashRAG's "acc": 1.0 if any normalized gold is a substring of the normalized prediction.

    This is a plain character substring test, as in FlashRAG, not a token match: gold "cat"
    is found in "concatenate", and a gold that normalizes to "" (e.g. "the") is found in
    every prediction.
    """
    pred = normalize_answer(prediction)
    return float(any(normalize_answer(gold) in pred for gold in _as_gold_list(golden_answers)))


def _token_f1(pred: str, gold: str) -> float:
    """Token F1 of two already normalized answers."""
    if pred != gold and (pred in _SPECIAL_ANSWERS or gold in _SPECIAL_ANSWERS):
        return 0.0
    pred_tokens = pred.split()
    gold_tokens = gold.split()
    # Multiset intersection: a token repeated in both counts min(count_pred, count_gold) times.
    num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        # Also covers an empty prediction or gold, which scores 0.0 as in FlashRAG.
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    # Same float operations as FlashRAG (not 2*n/(|p|+|g|)), so scores agree to the last bit.
    return (2 * precision * recall) / (precision + recall)


def f1_score(prediction: str, golden_answers: str | Sequence[str]) -> float:
    """Token-level F1 of the normalized prediction against each gold; the max is returned.

    A gold scores 0.0 when the prediction or that gold normalizes to "yes", "no" or
    "noanswer" and the two differ (FlashRAG/HotpotQA). With no token in common a gold scores
    0.0, including when both sides normalize to the empty string (FlashRAG and SQuAD v1.1;
    SQuAD v2.0 would give 1.0).
    """
    pred = normalize_answer(prediction)
    return max(_token_f1(pred, normalize_answer(gold)) for gold in _as_gold_list(golden_answers))


def split_answers(prediction: str) -> list[str]:
    """The answers of a multi-objective prediction: split on ";", each stripped."""
    return [answer.strip() for answer in prediction.split(";")]


def objective_sum(
    prediction: str,
    objectives: Sequence[Sequence[str]],
    metric: Callable[[str, Sequence[str]], float] = exact_match,
) -> float:
    """Sum over positions k of ``metric(answer_k, golds_k)``; 0.0 unless the prediction splits
    into exactly ``len(objectives)`` answers (the count rule)."""
    answers = split_answers(prediction)
    if len(answers) != len(objectives):
        return 0.0
    return float(sum(metric(a, golds) for a, golds in zip(answers, objectives, strict=True)))
