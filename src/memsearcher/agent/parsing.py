"""Pure parsers for the agent protocol (DESIGN section 4).

The model writes ``<think> ... </think>`` followed by exactly one action: a
``<tool_call>{json}</tool_call>`` or an answer containing ``\\boxed{...}``. After a tool call it
writes ``<memory> ... </memory>``. MEM1's protocol writes its action as ``<search> query
</search>`` or ``<answer> a1; a2 </answer>`` instead (`parse_mem1_action`). Every parser returns
a value or a ``ParseFailure`` and never raises, whatever the text: model output is arbitrary.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "FinalAnswer",
    "ParseFailure",
    "ParseFailureKind",
    "ShopStep",
    "ParsedAction",
    "ToolCall",
    "extract_boxed",
    "parse_action",
    "parse_mem1_action",
    "parse_memory",
    "parse_think",
    "parse_shop_action",
    "parse_tool_call",
]

ParseFailureKind = Literal[
    "missing_think",
    "unclosed_think",
    "no_action",
    "unclosed_answer",
    "ambiguous_action",
    "multiple_tool_calls",
    "unclosed_tool_call",
    "bad_tool_call",
    "empty_answer",
    "missing_memory",
    "unclosed_memory",
    "multiple_actions",
    "unclosed_action",
    "empty_query",
    "bad_action",
]


@dataclass(frozen=True)
class ParseFailure:
    kind: ParseFailureKind
    """Which rule of the protocol the text broke."""
    detail: str
    """Short human-readable explanation."""


@dataclass(frozen=True)
class ToolCall:
    query: str
    """The search query, stripped and non-empty."""
    top_n: int | None
    """Number of passages asked for (>= 1); None when the call did not give one."""


@dataclass(frozen=True)
class FinalAnswer:
    answer: str
    """Content of the last balanced ``\\boxed{}``, stripped and non-empty."""


@dataclass(frozen=True)
class ParsedAction:
    think: str
    """Stripped text inside ``<think> ... </think>``."""
    action: ToolCall | FinalAnswer
    """The one action written after the thought."""


_TOOL_CALL_OPEN, _TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
# An unclosed block runs to the end of the text.
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|\Z)", re.DOTALL)


def _tagged(
    text: str, tag: str, missing: ParseFailureKind, unclosed: ParseFailureKind
) -> tuple[str, int] | ParseFailure:
    """Stripped inner text of the first <tag> ... </tag> block and the index just past it."""
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    start = text.find(open_tag)
    if start < 0:
        return ParseFailure(missing, f"no {open_tag} tag")
    start += len(open_tag)
    end = text.find(close_tag, start)
    if end < 0:
        return ParseFailure(unclosed, f"{open_tag} is never closed by {close_tag}")
    return text[start:end].strip(), end + len(close_tag)


def parse_think(text: str) -> str | ParseFailure:
    """The stripped thought of the first <think> ... </think> block."""
    found = _tagged(text, "think", "missing_think", "unclosed_think")
    return found if isinstance(found, ParseFailure) else found[0]


def parse_memory(text: str) -> str | ParseFailure:
    """The stripped memory of the first <memory> ... </memory> block (may be empty)."""
    found = _tagged(text, "memory", "missing_memory", "unclosed_memory")
    return found if isinstance(found, ParseFailure) else found[0]


def _bad_call(detail: str) -> ParseFailure:
    return ParseFailure("bad_tool_call", detail)


def _call_from_json(body: str, tool_name: str) -> ToolCall | ParseFailure:
    try:
        call: Any = json.loads(body)
    # Huge ints raise ValueError (int_max_str_digits), deep nesting raises RecursionError.
    except (ValueError, RecursionError) as e:
        return _bad_call(f"tool call is not valid JSON ({e})")
    if not isinstance(call, dict):
        return _bad_call(f"tool call must be a JSON object, got {type(call).__name__}")
    name = call.get("name")
    if name != tool_name:
        # Never repr an arbitrary JSON value: a deeply nested one overflows the stack.
        shown = f"{name!r:.60}" if isinstance(name, str) else type(name).__name__
        return _bad_call(f"tool name is {shown}, expected {tool_name!r}")
    args = call.get("arguments")
    if not isinstance(args, dict):
        return _bad_call('"arguments" must be a JSON object')
    query = args.get("query")
    if not isinstance(query, str) or not query.strip():
        return _bad_call('"query" must be a non-empty string')
    top_n = args.get("top_n")
    # type() rather than isinstance(): bool is a subclass of int.
    if "top_n" in args and (type(top_n) is not int or top_n < 1):
        return _bad_call('"top_n" must be an integer >= 1')
    return ToolCall(query=query.strip(), top_n=top_n)


def parse_tool_call(
    text: str, tool_name: str = "wikipedia_search"
) -> ToolCall | ParseFailure | None:
    """The single <tool_call>{json}</tool_call> in text; None when there is no <tool_call>."""
    count = text.count(_TOOL_CALL_OPEN)
    if count == 0:
        return None
    if count > 1:
        return ParseFailure("multiple_tool_calls", f"{count} {_TOOL_CALL_OPEN} blocks, expected 1")
    start = text.find(_TOOL_CALL_OPEN) + len(_TOOL_CALL_OPEN)
    end = text.find(_TOOL_CALL_CLOSE, start)
    if end < 0:
        return ParseFailure("unclosed_tool_call", f"{_TOOL_CALL_OPEN} is never closed")
    return _call_from_json(text[start:end], tool_name)


def _macro_groups(text: str, macro: str) -> dict[int, int | None]:
    """Every ``macro{`` in text: the inner start of its group -> the inner end, or None when
    the group is never closed.

    One left-to-right pass with a stack, so many unbalanced occurrences stay linear. A backslash
    escapes the next character, as in LaTeX: ``\\{`` is a literal brace, not a group.
    """
    tokens = re.compile(re.escape(macro) + r"\{|\\.|[{}]", re.DOTALL)
    groups: dict[int, int | None] = {}
    opened: list[int | None] = []  # inner start of each open group; None for a plain brace
    for match in tokens.finditer(text):
        token = match.group()
        if token == "{":
            opened.append(None)
        elif token == "}":
            start = opened.pop() if opened else None
            if start is not None:
                groups[start] = match.start()
        elif token == macro + "{":
            opened.append(match.end())
            groups[match.end()] = None
    return groups


def extract_boxed(text: str) -> str | None:
    """Stripped content of the last ``\\boxed{...}``, one ``\\text{}`` unwrapped; None when
    there is none, or when the last one is never closed: the reference reward code
    (``last_boxed_only_string``) reads that as no answer, not as the one before it."""
    groups = _macro_groups(text, "\\boxed")
    if not groups:
        return None
    start = max(groups)
    end = groups[start]
    if end is None:
        return None
    answer = text[start:end].strip()
    # Unwrap only when a single \text{...} group spans the whole answer, not "\text{a} \text{b}".
    if _macro_groups(answer, "\\text").get(len("\\text{")) == len(answer) - 1:
        answer = answer[len("\\text{") : -1].strip()
    return answer


def parse_action(text: str, tool_name: str = "wikipedia_search") -> ParsedAction | ParseFailure:
    """The thought and the one action written after ``</think>``."""
    found = _tagged(text, "think", "missing_think", "unclosed_think")
    if isinstance(found, ParseFailure):
        return found
    think, end = found
    after = text[end:]
    call = parse_tool_call(after, tool_name)
    # A \boxed{} inside the tool call's JSON is part of the query, not an answer.
    outside = _TOOL_CALL_BLOCK.sub(" ", after)
    answer = extract_boxed(outside)
    if call is not None and answer is not None:
        return ParseFailure("ambiguous_action", "both a tool call and a \\boxed{} answer")
    if call is not None:
        return call if isinstance(call, ParseFailure) else ParsedAction(think, call)
    if answer is None and _macro_groups(outside, "\\boxed"):
        return ParseFailure("unclosed_answer", "the last \\boxed{ is never closed")
    if answer is None:
        return ParseFailure(
            "no_action", "neither a tool call nor a \\boxed{} answer after </think>"
        )
    if not answer:
        return ParseFailure("empty_answer", "the \\boxed{} answer is empty")
    return ParsedAction(think, FinalAnswer(answer))


def parse_mem1_action(text: str) -> ParsedAction | ParseFailure:
    """MEM1: the internal state ``<think> ... </think>``, then exactly one ``<search> query
    </search>`` or ``<answer> ... </answer>`` (MIT-MI/MEM1, ``generation_think.py``).

    The release takes the first of either tag wherever it appears; here the action must come
    after the internal state and be the only one, as in the other agents' protocol.
    """
    found = _tagged(text, "think", "missing_think", "unclosed_think")
    if isinstance(found, ParseFailure):
        return found
    think, end = found
    after = text[end:]
    searches, answers = after.count("<search>"), after.count("<answer>")
    if searches and answers:
        return ParseFailure("ambiguous_action", "both a <search> and an <answer>")
    if searches + answers == 0:
        return ParseFailure("no_action", "neither <search> nor <answer> after </think>")
    if searches + answers > 1:
        return ParseFailure("multiple_actions", f"{searches + answers} actions, expected 1")
    tag = "search" if searches else "answer"
    action = _tagged(after, tag, "no_action", "unclosed_action")
    if isinstance(action, ParseFailure):
        return action
    content = action[0]
    if tag == "search":
        if not content:
            return ParseFailure("empty_query", "the <search> query is empty")
        return ParsedAction(think, ToolCall(query=content, top_n=None))
    if not content:
        return ParseFailure("empty_answer", "the <answer> is empty")
    return ParsedAction(think, FinalAnswer(content))


@dataclass(frozen=True)
class ShopStep:
    """A shop turn: the thought, and the action text (``search[...]`` or ``click[...]``)."""

    think: str
    action: str


_SHOP_ACTION = re.compile(r"(?:search|click)\[.+\]", re.DOTALL | re.IGNORECASE)


def parse_shop_action(text: str) -> ShopStep | ParseFailure:
    """The shop's protocol: ``<think> ... </think>``, then one ``<action> search[keywords]
    </action>`` or ``<action> click[text] </action>``. Whether the click names something on
    the page is the environment's to say."""
    found = _tagged(text, "think", "missing_think", "unclosed_think")
    if isinstance(found, ParseFailure):
        return found
    think, end = found
    after = text[end:]
    if after.count("<action>") > 1:
        return ParseFailure("multiple_actions", f"{after.count('<action>')} actions, expected 1")
    action = _tagged(after, "action", "no_action", "unclosed_action")
    if isinstance(action, ParseFailure):
        return action
    if not _SHOP_ACTION.fullmatch(action[0]):
        return ParseFailure("bad_action", "the action is neither search[...] nor click[...]")
    return ShopStep(think, action[0])
