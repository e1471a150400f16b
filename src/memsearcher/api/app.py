"""The agent API: ``memsearcher serve`` answers questions with the search agent over HTTP.

    POST /v1/answer            {"question": str, "max_turns"?: int, "top_n"?: int,
                                "include_tokens": false, "stream": false}
                               -> {"answer", "end_reason", "error", "turns", "searches",
                                   "trajectory"}; streamed: newline-delimited JSON, an event
                                   a turn, then the result
    POST /v1/chat/completions  OpenAI-style: the last user message is the question; the answer
                               is the assistant message; streamed: OpenAI's chunks, the turns
                               as ``reasoning_content`` (``api.responses``)
    GET  /                     the trajectory viewer: a page that asks /v1/answer and draws each
                               turn as it streams (``memsearcher.web``)
    GET  /v1/models, GET /health

Requests waiting at the same moment are answered together: one worker thread takes them as
one lockstep batch (``max_batch`` questions), so the model sees batched prompts under load and
a lone request waits for nobody. With an HTTP model (``--backend openai``) each question runs
as its own asyncio task instead, and the model's server does the batching. Inputs are bounded
(``ServeConfig``); a bad request gets a 4xx with a JSON ``detail``, and a full queue gets 503
with ``Retry-After``. A question that fails in a batch is retried alone, so it fails alone.
A question whose client hangs up (or closes its stream) is dropped: it gives its place back at
once and stops at the end of the turn it is in. Questions pass through
``memsearcher.text.sanitize_text``. The server binds 127.0.0.1 unless told otherwise, and then
answers only requests addressed to a loopback name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from operator import attrgetter
from typing import Any, Literal

from memsearcher.agent import AgentConfig, Templates, run_lockstep, start_episodes
from memsearcher.api.responses import (
    Event,
    answer_body,
    answer_lines,
    chat_chunks,
    finish_reason,
    follow,
    summary,
    usage,
)
from memsearcher.errors import MemSearcherError
from memsearcher.llm.base import LLM, SamplingParams, is_async
from memsearcher.retrieval.base import Retriever
from memsearcher.serving import BodyGuard, HostGuard, add_error_handlers, unless_gone
from memsearcher.text import sanitize_text
from memsearcher.types import QAExample, Trajectory, Turn
from memsearcher.web import viewer_page
from memsearcher.worker import QueueWorker

try:
    import fastapi
    from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
    from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr
except ImportError as error:  # pragma: no cover - retrieval.server already says how
    raise MemSearcherError(
        f"serve needs fastapi: pip install 'memsearcher[server]' ({error})"
    ) from None

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    """Bounds on requests and batching."""

    max_question_chars: int = 2000
    """Longest question, in characters."""
    max_turns: int = 20
    """Upper bound (and default) of a request's ``max_turns``."""
    max_pending: int = 64
    """Questions waiting or running at once; more get 503."""
    max_batch: int = 16
    """Questions answered together in one lockstep batch."""
    max_body_bytes: int = 64 * 1024
    """Largest request body; larger ones get 413."""
    max_messages: int = 64
    """Most messages in one chat-completions request."""


class AnswerRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    question: StrictStr = Field(description="The question to answer.")
    max_turns: StrictInt | None = Field(None, ge=1, description="Turn limit (at most the server's)")
    top_n: StrictInt | None = Field(
        None, ge=1, le=AgentConfig.max_top_n, description="Passages per search"
    )
    include_tokens: StrictBool = Field(False, description="Also return the token sequences.")
    stream: StrictBool = Field(
        False, description="Newline-delimited JSON: an event a turn, then the result."
    )


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    messages: list[ChatMessage] = Field(min_length=1)
    model: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None


OnTurn = Callable[[Turn], None]


@dataclass
class Question:
    """A question waiting for the lockstep worker."""

    example: QAExample
    config: AgentConfig
    future: asyncio.Future[Trajectory]
    on_turn: OnTurn | None
    reported: int = 0
    """Turns told to ``on_turn``: a batch that fails is run again, one question at a time,
    and the turns it told are not told twice."""


class AgentService(QueueWorker[Question]):
    """Answers questions in batches on one worker thread."""

    def __init__(
        self,
        llm: LLM,
        retriever: Retriever,
        agent: str,
        agent_config: AgentConfig,
        sampling: SamplingParams,
        config: ServeConfig,
        templates: Templates | None = None,
    ) -> None:
        super().__init__("agent", config.max_pending)
        self.llm, self.retriever, self.agent = llm, retriever, agent
        self.agent_config, self.sampling, self.config = agent_config, sampling, config
        self.templates = templates

    def answer(
        self, question: str, agent_config: AgentConfig, on_turn: OnTurn | None = None
    ) -> asyncio.Task[Trajectory]:
        """Start answering ``question``: :class:`Busy` at once if the server is full, else the
        task, which holds the question's place until it ends, however it ends (cancel it to
        drop the question). ``on_turn(turn)`` runs on the event loop as each turn closes."""
        places = contextlib.ExitStack()
        places.enter_context(self.admit())
        example = QAExample(id=uuid.uuid4().hex, question=question, golden_answers=())
        task = asyncio.ensure_future(self._answer(example, agent_config, on_turn))
        task.add_done_callback(lambda _: places.close())
        return task

    async def _answer(
        self, example: QAExample, agent_config: AgentConfig, on_turn: OnTurn | None
    ) -> Trajectory:
        if is_async(self.llm):
            return await self._answer_alone(example, agent_config, on_turn)
        future: asyncio.Future[Trajectory] = asyncio.get_running_loop().create_future()
        await self.queue.put(Question(example, agent_config, future, on_turn))
        return await future

    async def _answer_alone(
        self, example: QAExample, agent_config: AgentConfig, on_turn: OnTurn | None
    ) -> Trajectory:
        """An HTTP model batches on its server: each question runs as its own task."""
        from memsearcher.agent.async_driver import run_async

        (episode,) = start_episodes(
            self.agent, [example], self.llm.tokenizer, agent_config, self.templates,
            self.llm.max_context_tokens,
        )  # fmt: skip
        llm: Any = self.llm  # an AsyncLLM (checked by _answer)
        report = None if on_turn is None else (lambda _, turn: on_turn(turn))
        (trajectory,) = await run_async(
            [episode], llm, self.retriever, self.sampling, on_turn=report
        )
        return trajectory

    def _answer_batch(
        self, loop: asyncio.AbstractEventLoop, questions: list[Question]
    ) -> list[Trajectory]:
        """One lockstep batch, on the worker thread."""
        episodes = [
            start_episodes(
                self.agent, [q.example], self.llm.tokenizer, q.config, self.templates,
                self.llm.max_context_tokens,
            )[0]
            for q in questions
        ]  # fmt: skip

        def on_turn(i: int, turn: Turn) -> None:
            question, episode = questions[i], episodes[i]
            if question.future.done() and not episode.done:  # dropped: its client hung up
                episode.end("cancelled", "the client hung up")
            elif question.on_turn is not None and turn.index >= question.reported:
                loop.call_soon_threadsafe(question.on_turn, turn)
                question.reported = turn.index + 1

        return run_lockstep(episodes, self.llm, self.retriever, self.sampling, on_turn)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            while len(batch) < self.config.max_batch and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            live = [q for q in batch if not q.future.done()]
            await self.run_apart(live, partial(self._run_batch, loop), attrgetter("future"))

    async def _run_batch(self, loop: asyncio.AbstractEventLoop, questions: list[Question]) -> None:
        results = await loop.run_in_executor(self.executor, self._answer_batch, loop, questions)
        for question, trajectory in zip(questions, results, strict=True):
            if not question.future.done():
                question.future.set_result(trajectory)


def create_app(
    service: AgentService,
    model_name: str = "memsearcher",
    hosts: frozenset[str] | None = None,
    docs: bool = False,
) -> fastapi.FastAPI:
    """The FastAPI application around ``service``: it answers requests for ``hosts`` only
    (None: any Host); ``docs`` serves /docs, a page that loads its scripts from a CDN."""
    config = service.config

    @contextlib.asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        service.start()
        yield
        await service.stop()

    app = fastapi.FastAPI(
        title="memsearcher agent",
        description="Questions answered by a search agent with a compact memory.",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url=None,
    )
    add_error_handlers(app)

    def check_question(question: str) -> str:
        question = sanitize_text(question.strip())
        if not question:
            raise fastapi.HTTPException(422, "the question is empty")
        if len(question) > config.max_question_chars:
            raise fastapi.HTTPException(
                422, f"the question is longer than {config.max_question_chars} characters"
            )
        return question

    def agent_config(max_turns: int | None, top_n: int | None) -> AgentConfig:
        if max_turns is not None and max_turns > config.max_turns:
            raise fastapi.HTTPException(422, f"max_turns must be at most {config.max_turns}")
        settings = service.agent_config
        if max_turns is not None:
            settings = replace(settings, max_turns=max_turns)
        if top_n is not None:
            settings = replace(settings, top_n=top_n)
        return settings

    def events(http: fastapi.Request, question: str, settings: AgentConfig) -> AsyncIterator[Event]:
        """The question's turns as they close, then its trajectory; :class:`Busy` at once (a 503,
        before the stream starts) if the server is full."""
        turns: asyncio.Queue[Turn | asyncio.Task[Trajectory]] = asyncio.Queue()
        work = service.answer(question, settings, turns.put_nowait)
        work.add_done_callback(turns.put_nowait)
        return follow(http, work, turns)

    @app.post("/v1/answer", summary="Answer a question with the agent")
    async def answer(request: AnswerRequest, http: fastapi.Request) -> Any:
        question = check_question(request.question)
        settings = agent_config(request.max_turns, request.top_n)
        if request.stream:
            lines = answer_lines(events(http, question, settings), request.include_tokens)
            return StreamingResponse(lines, media_type="application/x-ndjson")
        trajectory = await unless_gone(http, service.answer(question, settings))
        return JSONResponse(answer_body(trajectory, request.include_tokens))

    @app.post("/v1/chat/completions", summary="OpenAI-style: the last user message is asked")
    async def chat(request: ChatRequest, http: fastapi.Request) -> Any:
        if request.stream_options is not None and not request.stream:
            raise fastapi.HTTPException(422, "stream_options is only allowed when stream is true")
        if len(request.messages) > config.max_messages:
            raise fastapi.HTTPException(422, f"at most {config.max_messages} messages")
        users = [m.content for m in request.messages if m.role == "user" and m.content]
        if not users:
            raise fastapi.HTTPException(422, "no user message with text content")
        question = check_question(users[-1])
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            chunks = chat_chunks(
                events(http, question, service.agent_config), model_name, include_usage
            )
            return StreamingResponse(
                chunks, media_type="text/event-stream", headers={"cache-control": "no-cache"}
            )
        trajectory = await unless_gone(http, service.answer(question, service.agent_config))
        return JSONResponse(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model_name,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": trajectory.answer or ""},
                        "finish_reason": finish_reason(trajectory),
                    }
                ],
                "usage": usage(trajectory),
                "memsearcher": summary(trajectory),
            }
        )

    @app.get("/", include_in_schema=False)
    async def viewer() -> Any:
        page, policy = viewer_page()
        headers = {"content-security-policy": policy, "referrer-policy": "no-referrer"}
        return HTMLResponse(page, headers=headers)

    @app.get("/v1/models", summary="The one model served")
    async def models() -> Any:
        return JSONResponse(
            {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "me"}]}
        )

    @app.get("/health", summary="Liveness and limits")
    async def health() -> Any:
        return JSONResponse(
            {
                "status": "ok",
                "agent": service.agent,
                "model": model_name,
                "pending": service.pending,
                "limits": asdict(config),
            }
        )

    app.add_middleware(BodyGuard, max_bytes=config.max_body_bytes)
    app.add_middleware(HostGuard, hosts=hosts)  # added last, so it runs first
    return app
