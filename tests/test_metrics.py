"""Hand-computed cases for the FlashRAG answer metrics, plus property tests."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from memsearcher.eval.metrics import exact_match, f1_score, normalize_answer, sub_exact_match


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Cat", "cat"),
        ("  Hello,   World!  ", "hello world"),
        ("U.S.A.", "usa"),
        ("O'Brien", "obrien"),
        ("", ""),
        ("A an THE", ""),
        # Articles go only as whole words: "theory" and "Anna" keep theirs.
        ("theory of the atom", "theory of atom"),
        ("Anna and an apple", "anna and apple"),
        # Punctuation is removed before articles, so a hyphen glues "the" to its neighbour.
        ("the-end", "theend"),
        # Accents are not stripped, and non-ASCII punctuation is not in string.punctuation.
        ("Café", "café"),
        ("O’Brien", "o’brien"),
        ("rock—paper", "rock—paper"),
        # The em dash stays but is still a word boundary, so the "the" between dashes goes.
        ("rock—the—roll", "rock— —roll"),
        # str.split whitespace: tabs, newlines and the no-break space all collapse.
        ("tab\tand\nnew\u00a0line", "tab and new line"),
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    ("prediction", "golds", "expected"),
    [
        ("the Eiffel Tower!", ["Eiffel Tower"], 1.0),
        ("Café", ["cafe"], 0.0),
        ("Paris", "paris", 1.0),
        ("Paris", ["London", "PARIS."], 1.0),
        ("Paris, France", ["Paris"], 0.0),
        # A bare string is one gold: "b" would match if "abc" were read as ["a", "b", "c"].
        ("b", "abc", 0.0),
        # Both sides normalize to "" and so are equal (F1 scores this pair 0.0, see below).
        ("", ["the"], 1.0),
    ],
)
def test_exact_match(prediction: str, golds: str | list[str], expected: float) -> None:
    assert exact_match(prediction, golds) == expected


@pytest.mark.parametrize(
    ("prediction", "golds", "expected"),
    [
        ("It is the Eiffel Tower, in Paris", ["eiffel tower"], 1.0),
        ("Paris", ["Paris, France"], 0.0),
        ("café au lait", ["cafe"], 0.0),
        ("London", ["Paris", "lond"], 1.0),
        # FlashRAG tests characters, not tokens: a gold inside a longer word still counts.
        ("concatenate", ["cat"], 1.0),
        ("1999", ["99"], 1.0),
        # A gold that normalizes to "" is a substring of every prediction.
        ("anything", ["The"], 1.0),
    ],
)
def test_sub_exact_match(prediction: str, golds: list[str], expected: float) -> None:
    assert sub_exact_match(prediction, golds) == expected


@pytest.mark.parametrize(
    ("prediction", "golds", "expected"),
    [
        ("The Eiffel Tower", ["eiffel tower"], 1.0),
        ("Berlin", ["Paris"], 0.0),
        # [barack, obama] vs [obama]: common 1, p = 1/2, r = 1, f1 = 2*(1/2)/(3/2) = 2/3.
        ("barack obama", ["obama"], 2 / 3),
        # [cat, and, dog] vs [cat, dog] (articles gone): common 2, p = 2/3, r = 1,
        # f1 = 2*(2/3)/(5/3) = 4/5.
        ("the cat and a dog", ["cat dog"], 4 / 5),
        # Counter intersection: [new, york, new, york] vs [new, york, city] share
        # min(2,1) + min(2,1) = 2 tokens; p = 2/4, r = 2/3, f1 = 2*(1/2)(2/3)/(7/6) = 4/7.
        ("New York, New York", ["new york city"], 4 / 7),
        # {la: 2, land: 1} vs {la: 3}: common min(2,3) = 2; p = 2/3, r = 2/3, f1 = 2/3.
        ("la la land", ["la la la"], 2 / 3),
        # Max over golds: [obama] 2/3; [barack, hussein, obama] common 2, p = 1, r = 2/3,
        # f1 = 2*(2/3)/(5/3) = 4/5; [trump] 0. Max 4/5.
        ("barack obama", ["obama", "Barack Hussein Obama", "trump"], 4 / 5),
        # "café—bar" is one token (the em dash stays), so nothing is shared with [café, bar].
        ("Café—bar", ["café bar"], 0.0),
        ("Café", ["cafe"], 0.0),
        # Empty normalized prediction: no common token, 0.0.
        ("the", ["Paris"], 0.0),
        # Both sides empty: 0.0 in FlashRAG and SQuAD v1.1 (SQuAD v2.0 would say 1.0).
        ("the", ["a"], 0.0),
    ],
)
def test_f1_score(prediction: str, golds: list[str], expected: float) -> None:
    assert f1_score(prediction, golds) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("prediction", "golds", "expected"),
    [
        # Prediction is special and differs: 0.0. SQuAD would give partial credit,
        # common 1, p = 1, r = 1/2, f1 = 2*(1/2)/(3/2) = 2/3.
        ("yes", ["yes sir"], 0.0),
        ("noanswer", ["noanswer given"], 0.0),
        # Gold is special and differs: 0.0. SQuAD: common 1, p = 1/2, r = 1, f1 = 2/3.
        ("no way", ["No."], 0.0),
        # SQuAD: common 1, p = 1/3, r = 1, f1 = 2*(1/3)/(4/3) = 1/2.
        ("yes it is", ["Yes"], 0.0),
        # Equal after normalization: the ordinary path, 1.0.
        ("Yes!", ["yes"], 1.0),
        ("No-Answer", ["noanswer"], 1.0),
        # The rule zeroes one gold, not the whole question: the max still finds "Yes.".
        ("yes", ["yes sir", "Yes."], 1.0),
        ("yes", ["yes sir", "no"], 0.0),
        # Not special: "no answer" is two tokens. [no, answer] vs [no]: the gold "no" is
        # special and differs, 0.0; against [answer, no] it is ordinary, p = r = 1, 1.0.
        ("no answer", ["no"], 0.0),
        ("no answer", ["answer no"], 1.0),
    ],
)
def test_f1_yes_no_noanswer_rule(prediction: str, golds: list[str], expected: float) -> None:
    assert f1_score(prediction, golds) == pytest.approx(expected)


def test_single_string_gold_is_one_answer() -> None:
    # Read as characters, "obama" would give golds o, b, a, m, a and F1 0.
    assert f1_score("barack obama", "obama") == pytest.approx(2 / 3)
    assert sub_exact_match("xyz", "xbz") == 0.0


@pytest.mark.parametrize("metric", [exact_match, sub_exact_match, f1_score])
@pytest.mark.parametrize("empty", [[], ()])
def test_empty_gold_list_is_an_error(metric, empty) -> None:
    with pytest.raises(ValueError, match="golden_answers is empty"):
        metric("Paris", empty)


def test_exact_match_does_not_imply_f1_for_empty_answers() -> None:
    # FlashRAG's one exception to em == 1 => f1 == 1: both sides normalize to "".
    assert exact_match("a", ["the"]) == 1.0
    assert f1_score("a", ["the"]) == 0.0


answers = st.one_of(
    st.text(max_size=30),
    st.lists(
        st.sampled_from(
            ["the", "A", "an", "Yes", "no.", "NoAnswer", "cat", "Cat!", "café", "—", "new", "york"]
        ),
        max_size=6,
    ).map(" ".join),
)


@given(answers, st.lists(answers, min_size=1, max_size=3))
def test_metric_invariants(prediction: str, golds: list[str]) -> None:
    em = exact_match(prediction, golds)
    sub_em = sub_exact_match(prediction, golds)
    f1 = f1_score(prediction, golds)
    assert 0.0 <= f1 <= 1.0
    assert em <= sub_em
    if em == 1.0 and normalize_answer(prediction):
        assert f1 == 1.0


@given(answers)
def test_an_answer_matches_itself(text: str) -> None:
    if normalize_answer(text):
        assert exact_match(text, [text]) == 1.0
        assert sub_exact_match(text, [text]) == 1.0
        assert f1_score(text, [text]) == 1.0
