from __future__ import annotations

import json
from typing import get_args

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memsearcher.agent.parsing import (
    FinalAnswer,
    ParsedAction,
    ParseFailure,
    ParseFailureKind,
    ToolCall,
    extract_boxed,
    parse_action,
    parse_memory,
    parse_think,
    parse_tool_call,
)


def call_text(arguments: object, name: object = "wikipedia_search") -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def failure_kind(result: object) -> str | None:
    return result.kind if isinstance(result, ParseFailure) else None


# --- think -------------------------------------------------------------------------------------


def test_think_is_stripped() -> None:
    assert parse_think("<think>\n  weigh the options \n</think> rest") == "weigh the options"


def test_think_first_block_and_first_close() -> None:
    assert parse_think("pre <think>a</think> <think>b</think>") == "a"
    assert parse_think("</think> <think> a </think> b </think>") == "a"


def test_think_empty_is_allowed() -> None:
    assert parse_think("<think></think>") == ""


def test_think_missing() -> None:
    assert failure_kind(parse_think("no tags here </think>")) == "missing_think"


def test_think_unclosed() -> None:
    assert failure_kind(parse_think("<think> still thinking")) == "unclosed_think"


# --- tool call ---------------------------------------------------------------------------------


def test_tool_call_well_formed() -> None:
    text = call_text({"query": "  capital of France ", "top_n": 3})
    assert parse_tool_call(text) == ToolCall(query="capital of France", top_n=3)


def test_tool_call_top_n_absent() -> None:
    assert parse_tool_call(call_text({"query": "q"})) == ToolCall(query="q", top_n=None)


def test_tool_call_tolerates_whitespace_around_json() -> None:
    body = '\n  {"name": "wikipedia_search", "arguments": {"query": "q"}}  \n'
    assert parse_tool_call(f"<tool_call>{body}</tool_call>") == ToolCall("q", None)


def test_tool_call_none_without_open_tag() -> None:
    assert parse_tool_call("just text </tool_call>") is None


@pytest.mark.parametrize("top_n", [0, -1, True, False, 5.0, "5", None, [5], {"n": 5}])
def test_tool_call_invalid_top_n(top_n: object) -> None:
    result = parse_tool_call(call_text({"query": "q", "top_n": top_n}))
    assert isinstance(result, ParseFailure) and result.kind == "bad_tool_call"
    assert "top_n" in result.detail


def test_tool_call_huge_top_n_is_still_an_int() -> None:
    assert parse_tool_call(call_text({"query": "q", "top_n": 10**30})) == ToolCall("q", 10**30)


@pytest.mark.parametrize("name", ["google_search", "", None, 3, ["wikipedia_search"]])
def test_tool_call_wrong_name(name: object) -> None:
    result = parse_tool_call(call_text({"query": "q"}, name=name))
    assert isinstance(result, ParseFailure) and result.kind == "bad_tool_call"
    assert "name" in result.detail


def test_tool_call_custom_tool_name() -> None:
    text = call_text({"query": "q"}, name="search")
    assert parse_tool_call(text, tool_name="search") == ToolCall("q", None)
    assert failure_kind(parse_tool_call(text)) == "bad_tool_call"


@pytest.mark.parametrize("arguments", [None, "q", ["q"], {}, {"query": ""}, {"query": " \n"}])
def test_tool_call_bad_arguments(arguments: object) -> None:
    result = parse_tool_call(call_text(arguments))
    assert isinstance(result, ParseFailure) and result.kind == "bad_tool_call"
    assert "arguments" in result.detail or "query" in result.detail


@pytest.mark.parametrize(
    "body",
    [
        "",
        "{name: wikipedia_search}",
        '{"name": "wikipedia_search", "arguments": {"query": "q"}',
        '{"name": "wikipedia_search"} trailing',
        "[" * 100_000,
        '{"a": ' * 100_000,
        "9" * 10_000,
        '{"name": "wikipedia_search", "arguments": {"query": "q", "top_n": ' + "9" * 10_000 + "}}",
    ],
)
def test_tool_call_invalid_json(body: str) -> None:
    assert failure_kind(parse_tool_call(f"<tool_call>{body}</tool_call>")) == "bad_tool_call"


@pytest.mark.parametrize("body", ["[1, 2]", '"wikipedia_search"', "5", "null", "NaN", "true"])
def test_tool_call_non_object_json(body: str) -> None:
    result = parse_tool_call(f"<tool_call>{body}</tool_call>")
    assert isinstance(result, ParseFailure) and result.kind == "bad_tool_call"
    assert "object" in result.detail


def test_tool_call_nan_and_deep_name_do_not_raise() -> None:
    assert failure_kind(parse_tool_call(call_text({"query": "q", "top_n": float("nan")}))) == (
        "bad_tool_call"
    )
    deep_name = "[" * 900 + "]" * 900
    body = f'{{"name": {deep_name}, "arguments": {{"query": "q"}}}}'
    assert failure_kind(parse_tool_call(f"<tool_call>{body}</tool_call>")) == "bad_tool_call"


def test_tool_call_surrogates_in_query() -> None:
    text = '<tool_call>{"name": "wikipedia_search", "arguments": {"query": "\\ud800x"}}</tool_call>'
    assert parse_tool_call(text) == ToolCall("\ud800x", None)
    assert parse_tool_call(call_text({"query": "\udfff"})) == ToolCall("\udfff", None)


def test_tool_call_multiple() -> None:
    text = call_text({"query": "a"}) + call_text({"query": "b"})
    assert failure_kind(parse_tool_call(text)) == "multiple_tool_calls"


def test_tool_call_unclosed() -> None:
    text = '<tool_call>{"name": "wikipedia_search", "arguments": {"query": "q"}}'
    assert failure_kind(parse_tool_call(text)) == "unclosed_tool_call"


def test_tool_call_extra_keys_are_ignored() -> None:
    text = call_text({"query": "q", "lang": "en"}).replace('"name"', '"id": 1, "name"')
    assert parse_tool_call(text) == ToolCall("q", None)


# --- boxed -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is \\boxed{Paris}.", "Paris"),
        ("\\boxed{  spaced out  }", "spaced out"),
        ("\\boxed{a{b}c}", "a{b}c"),
        ("\\boxed{f(\\{x\\})}", "f(\\{x\\})"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{first} then \\boxed{second}", "second"),
        ("\\boxed{unbalanced \\boxed{good}", "good"),
        ("\\boxed{a}} \\boxed{b}", "b"),
        ("\\boxed{\\text{Barack Obama}}", "Barack Obama"),
        ("\\boxed{ \\text{ padded } }", "padded"),
        ("\\boxed{\\text{a} and \\text{b}}", "\\text{a} and \\text{b}"),
        ("\\boxed{\\text{a}b}", "\\text{a}b"),
        ("\\boxed{\\textbf{bold}}", "\\textbf{bold}"),
        ("\\boxed{\\{}", "\\{"),
        ("\\boxed{}", ""),
        ("\\boxed{\\boxed{inner}}", "inner"),
    ],
)
def test_extract_boxed(text: str, expected: str) -> None:
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "no answer",
        "\\boxed{never closed",
        "\\boxed{a\\}",
        "\\boxed x",
        "\\\\boxed{x}",
        "",
        # the last \boxed decides, as the reference's last_boxed_only_string: unclosed is none
        "first \\boxed{wrong} then \\boxed{Paris",
        "\\boxed{a}} \\boxed{b{",
    ],
)
def test_extract_boxed_none(text: str) -> None:
    assert extract_boxed(text) is None


def test_extract_boxed_many_unbalanced_is_fast() -> None:
    # Linear scan: 20k unbalanced openings must not go quadratic.
    assert extract_boxed("\\boxed{x} " + "\\boxed{" * 20_000) is None
    assert extract_boxed("\\boxed{" * 20_000 + " \\boxed{x}") == "x"


# --- action ------------------------------------------------------------------------------------


def test_action_tool_call() -> None:
    text = "<think> need facts </think>\n" + call_text({"query": "Eiffel tower", "top_n": 2})
    assert parse_action(text) == ParsedAction("need facts", ToolCall("Eiffel tower", 2))


def test_action_answer() -> None:
    text = "<think>known</think>\nSo the answer is \\boxed{\\text{1889}}."
    assert parse_action(text) == ParsedAction("known", FinalAnswer("1889"))


def test_action_think_failures_pass_through() -> None:
    assert failure_kind(parse_action("\\boxed{x}")) == "missing_think"
    assert failure_kind(parse_action("<think> \\boxed{x}")) == "unclosed_think"


def test_action_think_only() -> None:
    assert failure_kind(parse_action("<think>hmm</think>")) == "no_action"


def test_action_inside_think_does_not_count() -> None:
    assert failure_kind(parse_action("<think>maybe \\boxed{x}</think> done")) == "no_action"
    inner_call = call_text({"query": "q"})
    assert failure_kind(parse_action(f"<think>{inner_call}</think>")) == "no_action"
    text = f"<think>{inner_call} or \\boxed{{y}}</think>" + call_text({"query": "real"})
    assert parse_action(text) == ParsedAction(
        f"{inner_call} or \\boxed{{y}}", ToolCall("real", None)
    )


def test_action_ambiguous() -> None:
    text = "<think>t</think>" + call_text({"query": "q"}) + " \\boxed{x}"
    assert failure_kind(parse_action(text)) == "ambiguous_action"


def test_action_boxed_inside_tool_call_is_part_of_the_query() -> None:
    # JSON reads "\b" as a backspace, so this raw text holds a balanced \boxed{x}.
    body = '{"name": "wikipedia_search", "arguments": {"query": "\\boxed{x}"}}'
    assert parse_action(f"<think>t</think><tool_call>{body}</tool_call>") == ParsedAction(
        "t", ToolCall("\x08oxed{x}", None)
    )


def test_action_tool_call_failures() -> None:
    two = call_text({"query": "a"}) + call_text({"query": "b"})
    assert failure_kind(parse_action(f"<think>t</think>{two}")) == "multiple_tool_calls"
    unclosed = '<tool_call>{"name": "wikipedia_search"'
    assert failure_kind(parse_action(f"<think>t</think>{unclosed}")) == "unclosed_tool_call"
    bad = call_text({"query": "q"}, name="bing")
    assert failure_kind(parse_action(f"<think>t</think>{bad}")) == "bad_tool_call"


@pytest.mark.parametrize("boxed", ["\\boxed{}", "\\boxed{   }", "\\boxed{\\text{ }}"])
def test_action_empty_answer(boxed: str) -> None:
    assert failure_kind(parse_action(f"<think>t</think> {boxed}")) == "empty_answer"


def test_action_unclosed_last_boxed_is_no_answer() -> None:
    assert failure_kind(parse_action("<think>t</think> \\boxed{x")) == "unclosed_answer"
    text = "<think>t</think> first \\boxed{wrong} then \\boxed{Paris"
    assert failure_kind(parse_action(text)) == "unclosed_answer"


def test_action_custom_tool_name() -> None:
    text = "<think>t</think>" + call_text({"query": "q"}, name="search")
    assert parse_action(text, tool_name="search") == ParsedAction("t", ToolCall("q", None))


# --- memory ------------------------------------------------------------------------------------


def test_memory_stripped() -> None:
    assert parse_memory("<memory>\n- Paris is in France\n</memory>") == "- Paris is in France"


def test_memory_empty_is_allowed() -> None:
    assert parse_memory("<memory>  </memory>") == ""


def test_memory_first_block() -> None:
    assert parse_memory("x <memory>a</memory><memory>b</memory>") == "a"


def test_memory_missing() -> None:
    assert failure_kind(parse_memory("facts without tags </memory>")) == "missing_memory"


def test_memory_unclosed() -> None:
    assert failure_kind(parse_memory("<memory> cut off by the token budget")) == "unclosed_memory"


# --- fuzzing -----------------------------------------------------------------------------------

FAILURE_KINDS = set(get_args(ParseFailureKind))

FRAGMENTS = [
    "<think>", "</think>", "<tool_call>", "</tool_call>", "<memory>", "</memory>",
    "\\boxed{", "\\text{", "\\", "{", "}", "[", "]", '"', ":", ",", " ", "\n",
    '{"name": "wikipedia_search", "arguments": ', '{"query": ', '"top_n": ', '"q"', '" "',
    "5", "0", "-1", "1.5", "true", "null", "NaN", "-Infinity", "1e400", "9" * 5000,
    '"\\ud800"', "\ud800", "[" * 2000, "}}",
]  # fmt: skip

protocol_text = st.lists(st.sampled_from(FRAGMENTS) | st.text(max_size=4), max_size=30).map("".join)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(
            st.sampled_from(["name", "arguments", "query", "top_n"]), inner, max_size=3
        )
    ),
    max_leaves=8,
)


def mostly(
    valid: st.SearchStrategy[object], other: st.SearchStrategy[object] = json_values
) -> st.SearchStrategy[object]:
    """Valid values three times in four, else the other (by default any JSON value)."""
    # flatmap: a repeated branch in one_of(valid, valid, valid, other) adds no weight (measured).
    return st.integers(0, 3).flatmap(lambda i: valid if i else other)


# Calls with one field or another fuzzed, so the name, arguments, query and top_n checks all run.
call_like = st.fixed_dictionaries(
    {
        "name": mostly(st.just("wikipedia_search")),
        "arguments": mostly(
            st.fixed_dictionaries(
                {"query": mostly(st.text(min_size=1, max_size=8))},
                optional={"top_n": mostly(st.integers(min_value=-1, max_value=10))},
            )
        ),
    }
)
json_text = mostly(call_like).map(json.dumps)
# Protocol-shaped text with fuzzed parts: random text rarely reaches the grammar's deep branches.
tool_call_part = mostly(json_text, protocol_text).map(lambda body: f"<tool_call>{body}</tool_call>")
boxed_part = (
    protocol_text | st.text(max_size=8) | st.text(max_size=8).map(lambda s: f"\\text{{{s}}}")
).map(lambda s: f"\\boxed{{{s}}}")
action_text = (
    tool_call_part
    | boxed_part
    | st.lists(tool_call_part | boxed_part | protocol_text, max_size=3).map("".join)
)
shaped_text = st.tuples(protocol_text, action_text).map(lambda p: f"<think>{p[0]}</think>{p[1]}")
any_text = st.text() | protocol_text | shaped_text


def check_failure(result: object) -> bool:
    if isinstance(result, ParseFailure):
        assert result.kind in FAILURE_KINDS and isinstance(result.detail, str)
        return True
    return False


def check_tool_call(call: object) -> None:
    assert isinstance(call, ToolCall)
    assert call.query and call.query == call.query.strip()
    assert call.top_n is None or (type(call.top_n) is int and call.top_n >= 1)


@settings(max_examples=400, deadline=None)
@given(any_text)
def test_fuzz_parsers_return_declared_types(text: str) -> None:
    think = parse_think(text)
    assert check_failure(think) or isinstance(think, str)

    memory = parse_memory(text)
    assert check_failure(memory) or isinstance(memory, str)

    boxed = extract_boxed(text)
    assert boxed is None or (isinstance(boxed, str) and boxed == boxed.strip())

    call = parse_tool_call(text)
    if call is not None and not check_failure(call):
        check_tool_call(call)

    action = parse_action(text)
    if not check_failure(action):
        assert isinstance(action, ParsedAction) and action.think == think
        if isinstance(action.action, FinalAnswer):
            assert action.action.answer
        else:
            check_tool_call(action.action)


@settings(max_examples=300, deadline=None)
@given(mostly(json_text, protocol_text))
def test_fuzz_tool_call_bodies(body: str) -> None:
    call = parse_tool_call(f"<tool_call>{body}</tool_call>")
    if not check_failure(call):
        check_tool_call(call)
    action = parse_action(f"<think>t</think><tool_call>{body}</tool_call>")
    if not check_failure(action):
        assert isinstance(action, ParsedAction) and action.action == call


TAGS = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<memory>", "</memory>")
tag_free = st.text().filter(lambda s: not any(tag in s for tag in TAGS))
non_blank = tag_free.filter(lambda s: bool(s.strip()))
# A trailing backslash would escape the closing brace of \boxed{...}.
answers = non_blank.filter(lambda s: "{" not in s and "}" not in s and not s.endswith("\\"))


@settings(max_examples=200, deadline=None)
@given(tag_free, non_blank, st.none() | st.integers(min_value=1), st.booleans())
def test_round_trip_tool_call(think: str, query: str, top_n: int | None, ascii_: bool) -> None:
    arguments: dict[str, object] = {"query": query}
    if top_n is not None:
        arguments["top_n"] = top_n
    body = json.dumps({"name": "wikipedia_search", "arguments": arguments}, ensure_ascii=ascii_)
    text = f"<think>{think}</think>\n<tool_call>{body}</tool_call>"
    assert parse_action(text) == ParsedAction(think.strip(), ToolCall(query.strip(), top_n))


@settings(max_examples=200, deadline=None)
@given(tag_free, answers)
def test_round_trip_answer(think: str, answer: str) -> None:
    text = f"<think>{think}</think>\nThe answer is \\boxed{{{answer}}}."
    assert parse_action(text) == ParsedAction(think.strip(), FinalAnswer(answer.strip()))


@settings(max_examples=100, deadline=None)
@given(tag_free)
def test_round_trip_memory(memory: str) -> None:
    assert parse_memory(f"<memory>{memory}</memory>\n") == memory.strip()
