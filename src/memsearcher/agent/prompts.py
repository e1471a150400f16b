"""Every text the agents show the model, in one place.

The tags (``<think>``, ``<tool_call>``, ``<tool_response>``, ``<memory>``, ``\\boxed{}``; MEM1's
``<search>``, ``<answer>``, ``<information>`` and ``[HINT]``) and the roles are fixed by the
protocols: released checkpoints depend on them. The wording around them is ours, and a user can
override any template from a YAML or JSON file (`load_templates`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from memsearcher.errors import MemSearcherError
from memsearcher.types import Hit, QAExample

TOOL_NAME = "wikipedia_search"

T = TypeVar("T")


def tool_schema(default_top_n: int = 5) -> dict[str, Any]:
    """The search tool as a JSON function schema."""
    return {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "Search Wikipedia and return the most relevant passages.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "The search query."},
                    "top_n": {
                        "type": "integer",
                        "description": "How many passages to return.",
                        "default": default_top_n,
                    },
                },
                "required": ["query"],
            },
        },
    }


_ACTIONS = """\
Answer the question by searching Wikipedia. First think step by step inside <think> </think>. \
Then do exactly one of:
- search: <tool_call>{{"name": "wikipedia_search", "arguments": {{"query": "your query"}}}}\
</tool_call>
- answer: write the final answer, a short phrase, as \\boxed{{answer}}

Tools:
<tools>
{tools}
</tools>"""

MEMSEARCHER_SYSTEM = (
    _ACTIONS
    + """

You see the question and your memory: notes you wrote after earlier searches. After a search \
you get passages inside <tool_response> </tool_response>. Then rewrite your memory inside \
<memory> </memory>, keeping every fact that helps answer the question and dropping the rest. \
Only the question and this memory are kept for the next turn.

Example turn:
<think> I need to know who wrote Hamlet. </think>
<tool_call>{{"name": "wikipedia_search", "arguments": {{"query": "Hamlet author"}}}}</tool_call>
Example final turn:
<think> My memory says William Shakespeare wrote Hamlet. </think>
The answer is \\boxed{{William Shakespeare}}"""
)

REACT_SYSTEM = (
    _ACTIONS
    + """

After a search you get passages inside <tool_response> </tool_response>; then continue.

Example turn:
<think> I need to know who wrote Hamlet. </think>
<tool_call>{{"name": "wikipedia_search", "arguments": {{"query": "Hamlet author"}}}}</tool_call>
Example final turn:
<think> The passages say William Shakespeare wrote Hamlet. </think>
The answer is \\boxed{{William Shakespeare}}"""
)

# MEM1 puts its instructions and the questions in one user message (MIT-MI/MEM1,
# gen_data/data_process/qa_search_*_multi.py); the wording here is ours.
MEM1_USER = """\
Answer the questions below by searching Wikipedia, one step at a time. At each step you see \
only the questions, your previous step and the search results it brought back, so carry \
forward everything you need yourself.

At every step:
1. Reason inside <think> </think>, and keep there a cumulative summary: every fact found so \
far in earlier <think> and <information> blocks, and the answers already known.
2. Then do exactly one of:
- search: a short keyword query for one question inside <search> </search>; the results come \
back inside <information> </information>
- answer: once every question is answered, the answers in order, separated by semicolons, \
inside <answer> </answer>, e.g. <answer> Paris; 1889 </answer>

Questions: {questions}"""

MULTI_QUESTION = (
    "Answer these {count} questions in order, all in one \\boxed{{}} with the answers "
    "separated by semicolons, e.g. \\boxed{{answer 1; answer 2}}: {questions}"
)


@dataclass(frozen=True)
class Templates:
    """The texts of both agents; ``{name}`` fields are filled in at run time."""

    memsearcher_system: str = MEMSEARCHER_SYSTEM
    """MemSearcher's system message; ``{tools}`` is the tool schema as JSON."""
    memsearcher_user: str = "<question> {question} </question>\n\n<memory> {memory} </memory>"
    """The one user message of each MemSearcher turn."""
    memsearcher_tool_response: str = (
        "<tool_response>\n{passages}\n</tool_response>\n\n"
        "Now rewrite your memory inside <memory> </memory>: keep the facts that help answer "
        "the question."
    )
    """Search results, and the request to update the memory."""
    react_system: str = REACT_SYSTEM
    """The ReAct baseline's system message; ``{tools}`` is the tool schema as JSON."""
    react_user: str = "<question> {question} </question>"
    """The ReAct baseline's first user message."""
    react_tool_response: str = "<tool_response>\n{passages}\n</tool_response>"
    """Search results in the ReAct conversation."""
    answer_lead: str = (
        "<think> I have searched this already, so I answer from what I found. </think>\n"
        "The answer is \\boxed{{"
    )
    """What an action is replaced by when ``AgentConfig.answer_on_repeat`` meets a repeated
    query; the model writes the answer after it (a format string: braces doubled)."""
    multi_question: str = MULTI_QUESTION
    """MemSearcher's and ReAct's question when a task has several objectives (``{count}``
    of them, ``{questions}`` joined by "; ")."""
    mem1_user: str = MEM1_USER
    """MEM1's one user message: instructions and ``{questions}``."""
    mem1_information: str = "\n\n<information>{hint}\n\n{passages}</information>\n\n"
    """MEM1's observation, appended to its response as it is (no chat-template glue)."""
    mem1_hint: str = "[HINT]You have {turns_left} turns left.[/HINT]"
    """The turns-left hint at the head of each observation."""
    mem1_last_hint: str = (
        "[HINT]You have 1 turn left. You must answer the question in the next turn.[/HINT]"
    )
    """The hint before the last turn."""

    def __post_init__(self) -> None:
        check_fields(self, _FIELDS)


def check_fields(templates: Any, allowed: dict[str, set[str]]) -> None:
    """Raise unless every template of the dataclass ``templates`` is a string that uses only
    the ``{fields}`` that ``allowed`` gives its name."""
    for field in dataclasses.fields(templates):
        text = getattr(templates, field.name)
        if not isinstance(text, str):
            raise MemSearcherError(f"template {field.name!r} must be a string")
        try:
            found = {name for _, name, _, _ in string.Formatter().parse(text) if name}
        except ValueError as error:
            raise MemSearcherError(f"template {field.name!r}: {error}") from error
        unknown = found - allowed[field.name]
        if unknown:
            raise MemSearcherError(
                f"template {field.name!r} uses unknown fields {sorted(unknown)}; "
                f"allowed: {sorted(allowed[field.name])}"
            )


_FIELDS = {
    "memsearcher_system": {"tools"},
    "memsearcher_user": {"question", "memory"},
    "memsearcher_tool_response": {"passages"},
    "react_system": {"tools"},
    "react_user": {"question"},
    "react_tool_response": {"passages"},
    "answer_lead": set(),
    "multi_question": {"count", "questions"},
    "mem1_user": {"questions"},
    "mem1_information": {"hint", "passages"},
    "mem1_hint": {"turns_left"},
    "mem1_last_hint": set(),
}


def load_templates(path: str | Path | None = None) -> Templates:
    """The default templates, with any fields a YAML or JSON file overrides."""
    return read_templates(path, Templates)


def read_templates(path: str | Path | None, kind: type[T]) -> T:
    """The default templates of ``kind`` (the search agents' `Templates`, or
    `shop_agents.ShopTemplates`), with any fields the YAML or JSON file ``path`` overrides."""
    if path is None:
        return kind()
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise MemSearcherError(f"cannot read templates file {path}: {error}") from error
    import yaml  # YAML is a superset of JSON, so one loader reads both

    try:
        overrides = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise MemSearcherError(f"{path} is not valid YAML or JSON: {error}") from error
    if not isinstance(overrides, dict):
        raise MemSearcherError(f"{path} must hold a mapping of template names to texts")
    known = {field.name for field in dataclasses.fields(kind)}  # type: ignore[arg-type]
    unknown = set(overrides) - known
    if unknown:
        raise MemSearcherError(
            f"{path}: unknown templates {sorted(unknown)}; known: {sorted(known)}"
        )
    return kind(**overrides)


def format_tools(default_top_n: int) -> str:
    return json.dumps(tool_schema(default_top_n), ensure_ascii=False)


_NEWLINES = re.compile(r"\s*\n\s*")


def format_hits(hits: Sequence[Hit]) -> str:
    """Hits as the model reads them: ``Doc {i} (Title: {title}) {text}``, one line each (the
    one place they are written out for the model)."""
    return "\n".join(
        f"Doc {i} (Title: {hit.title}) {_NEWLINES.sub(' ', hit.text)}"
        for i, hit in enumerate(hits, start=1)
    )


def question_text(example: QAExample, templates: Templates) -> str:
    """The question as MemSearcher and ReAct show it: as is, or with the instruction to answer
    every objective of a multi-objective task in one ``\\boxed{}``."""
    count = len(example.objectives)
    if count == 1:
        return example.question
    return templates.multi_question.format(count=count, questions=example.question)


def mem1_hint(templates: Templates, turns_left: int) -> str:
    """MEM1's hint for an observation followed by ``turns_left`` turns (none: no hint)."""
    if turns_left > 1:
        return templates.mem1_hint.format(turns_left=turns_left)
    return templates.mem1_last_hint if turns_left == 1 else ""
