"""What ``memsearcher serve`` sends: the answer's body, and the two streamed forms.

- ``POST /v1/answer`` with ``"stream": true``: newline-delimited JSON, one
  ``{"event": "turn", "turn": {...}}`` a turn as it closes, then
  ``{"event": "result", "result": {...}}`` holding the body the plain call returns (or
  ``{"event": "error", "detail": ...}``).
- ``POST /v1/chat/completions`` with ``"stream": true``: server-sent events in OpenAI's
  ``chat.completion.chunk`` format. Each turn's thought, query, hit titles and new memory go out
  as ``delta.reasoning_content`` (the field DeepSeek's API and vLLM's reasoning parsers use, which
  chat front-ends show as thinking), the answer as ``delta.content``; then the chunk with
  ``finish_reason``, the usage chunk (``choices`` empty) if ``stream_options.include_usage``,
  and ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from memsearcher.serving import ClientGone, fault_detail, unless_gone
from memsearcher.types import Trajectory, Turn

if TYPE_CHECKING:
    from fastapi import Request

logger = logging.getLogger(__name__)

Event = Turn | Trajectory


def answer_body(trajectory: Trajectory, include_tokens: bool) -> dict[str, Any]:
    """What ``POST /v1/answer`` returns."""
    data = trajectory.to_dict()
    if not include_tokens:
        data.pop("sequences", None)
    data["example"].pop("golden_answers", None)
    return {
        "answer": trajectory.answer,
        "end_reason": trajectory.end_reason,
        "error": trajectory.error,
        "turns": len(trajectory.turns),
        "searches": trajectory.num_searches,
        "trajectory": data,
    }


def usage(trajectory: Trajectory) -> dict[str, int]:
    """OpenAI's ``usage``: the prompt and generated tokens of every model call, summed."""
    prompt_tokens = sum(t.prompt_tokens for t in trajectory.turns)
    completion_tokens = sum(t.generated_tokens for t in trajectory.turns)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def summary(trajectory: Trajectory) -> dict[str, Any]:
    """How the agent ended, beside OpenAI's fields (under ``"memsearcher"``)."""
    return {
        "end_reason": trajectory.end_reason,
        "error": trajectory.error,
        "turns": len(trajectory.turns),
        "searches": trajectory.num_searches,
    }


def finish_reason(trajectory: Trajectory) -> str:
    return "stop" if trajectory.answer is not None else "length"


def reasoning_text(turn: Turn) -> str:
    """A turn as ``reasoning_content``: its thought, query, hit titles and new memory."""
    lines = [f"Turn {turn.index + 1} (context {turn.prompt_tokens} tokens)"]
    if turn.thought is not None:
        lines.append(f"Thought: {turn.thought}")
    if turn.repeated_query is not None:
        lines.append(f"Repeated: {turn.repeated_query} (searched before: answer asked for)")
    if turn.query is not None:
        lines.append(f"Search: {turn.query}")
        lines.append(f"Hits: {'; '.join(hit.title for hit in turn.hits) or '(none)'}")
    if turn.memory_text is not None and turn.error is None:
        lines.append(f"Memory: {turn.memory or ''}")
    if turn.error is not None:
        lines.append(f"Error: {turn.error}")
    return "\n".join(lines) + "\n\n"


async def follow(
    request: Request,
    work: asyncio.Task[Trajectory],
    events: asyncio.Queue[Turn | asyncio.Task[Trajectory]],
) -> AsyncIterator[Event]:
    """The turns of ``work`` as ``events`` gets them, then its trajectory (or its error).

    ``events`` holds the turns, then ``work`` itself once it is done. When the client hangs up
    or the stream is closed, ``work`` is cancelled: the question gives its place back and
    stops at the end of the turn it is in.
    """
    try:
        while isinstance(event := await unless_gone(request, events.get()), Turn):
            yield event
        yield event.result()
    except ClientGone:
        logger.info("%s %s: the client hung up mid-stream", request.method, request.url.path)
    finally:
        work.cancel()


async def answer_lines(events: AsyncIterator[Event], include_tokens: bool) -> AsyncIterator[str]:
    """``/v1/answer``'s stream: a JSON line a turn, then one with the result."""
    try:
        async for event in events:
            if isinstance(event, Turn):
                line = {"event": "turn", "turn": asdict(event)}
            else:
                line = {"event": "result", "result": answer_body(event, include_tokens)}
            yield json.dumps(line, ensure_ascii=False) + "\n"
    except Exception as error:
        logger.error("a streamed question failed", exc_info=error)
        yield json.dumps({"event": "error", "detail": fault_detail(error)}) + "\n"


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def chat_chunks(
    events: AsyncIterator[Event], model: str, include_usage: bool
) -> AsyncIterator[str]:
    """``/v1/chat/completions``' stream, in OpenAI's chunk format (module docstring)."""
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        body = {**head, "choices": [choice], **extra}
        if include_usage:  # every chunk but the usage chunk says "usage": null (OpenAI's docs)
            body["usage"] = None
        return _sse(body)

    yield chunk({"role": "assistant", "content": ""})
    try:
        async for event in events:
            if isinstance(event, Turn):
                yield chunk({"reasoning_content": reasoning_text(event)})
                continue
            if event.answer:
                yield chunk({"content": event.answer})
            yield chunk({}, finish_reason(event), memsearcher=summary(event))
            if include_usage:
                yield _sse({**head, "choices": [], "usage": usage(event)})
            yield "data: [DONE]\n\n"
    except Exception as error:
        logger.error("a streamed question failed", exc_info=error)
        # what OpenAI-compatible servers send once the 200 is out; the client raises on it
        yield _sse({"error": {"message": fault_detail(error), "type": "internal_error"}})
        yield "data: [DONE]\n\n"
