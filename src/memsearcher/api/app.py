"""The agent API: ``memsearcher serve`` answers questions with the search agent over HTTP.

    POST /v1/answer            {"question": str, "max_turns"?: int, "top_n"?: int,
                                "include_tokens": false}
                               -> {"answer", "end_reason", "error", "turns", "searches",
                                   "trajectory"}
    POST /v1/chat/completions  OpenAI-style: the last user message is the question; the answer
                               is the assistant message (no streaming)
    GET  /v1/models, GET /health

Requests waiting at the same moment are answered together: one worker thread takes them as
one lockstep batch (``max_batch`` questions), so the model sees batched prompts under load and
a lone request waits for nobody. With an HTTP model (``--backend openai``) each question runs
as its own asyncio task instead, and the model's server does the batching. Inputs are bounded
(``ServeConfig``); a bad request gets a 4xx with a JSON ``detail``, and a full queue gets 503
with ``Retry-After``. A question that fails in a batch is retried alone, so it fails alone.
Questions pass through ``memsearcher.text.sanitize_text``. The server binds 127.0.0.1 unless
told otherwise, and then answers only requests addressed to a loopback name.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, replace
from functools import partial
from operator import itemgetter
from typing import Any, Literal

from memsearcher.agent import AgentConfig, Templates, run_lockstep, start_episodes
from memsearcher.errors import MemSearcherError
from memsearcher.llm.base import LLM, SamplingParams, is_async
from memsearcher.retrieval.base import Retriever
from memsearcher.serving import BodyGuard, HostGuard, add_error_handlers, unless_gone
from memsearcher.text import sanitize_text
from memsearcher.types import QAExample, Trajectory
from memsearcher.worker import QueueWorker

try:
    import fastapi
    from fastapi.responses import JSONResponse
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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr | None = None


class ChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    messages: list[ChatMessage] = Field(min_length=1)
    model: StrictStr | None = None
    stream: StrictBool = False


class AgentService(QueueWorker[tuple[QAExample, AgentConfig, asyncio.Future[Trajectory]]]):
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

    async def answer(self, question: str, agent_config: AgentConfig) -> Trajectory:
        with self.admit():
            example = QAExample(id=uuid.uuid4().hex, question=question, golden_answers=())
            if is_async(self.llm):
                return await self._answer_alone(example, agent_config)
            future: asyncio.Future[Trajectory] = asyncio.get_running_loop().create_future()
            await self.queue.put((example, agent_config, future))
            return await future

    async def _answer_alone(self, example: QAExample, agent_config: AgentConfig) -> Trajectory:
        """An HTTP model batches on its server: each question runs as its own task."""
        from memsearcher.agent.async_driver import run_async

        (episode,) = start_episodes(
            self.agent, [example], self.llm.tokenizer, agent_config, self.templates,
            self.llm.max_context_tokens,
        )  # fmt: skip
        llm: Any = self.llm  # an AsyncLLM (checked by answer)
        (trajectory,) = await run_async([episode], llm, self.retriever, self.sampling)
        return trajectory

    def _answer_batch(self, items: list[tuple[QAExample, AgentConfig]]) -> list[Trajectory]:
        episodes = [
            start_episodes(
                self.agent, [example], self.llm.tokenizer, config, self.templates,
                self.llm.max_context_tokens,
            )[0]
            for example, config in items
        ]  # fmt: skip
        return run_lockstep(episodes, self.llm, self.retriever, self.sampling)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self.queue.get()]
            while len(batch) < self.config.max_batch and not self.queue.empty():
                batch.append(self.queue.get_nowait())
            live = [item for item in batch if not item[2].done()]
            await self.run_apart(live, partial(self._answer, loop), itemgetter(2))

    async def _answer(
        self,
        loop: asyncio.AbstractEventLoop,
        items: list[tuple[QAExample, AgentConfig, asyncio.Future[Trajectory]]],
    ) -> None:
        results = await loop.run_in_executor(
            self.executor, self._answer_batch, [(e, c) for e, c, _ in items]
        )
        for (_, _, future), trajectory in zip(items, results, strict=True):
            if not future.done():
                future.set_result(trajectory)


def _trajectory_body(trajectory: Trajectory, include_tokens: bool) -> dict[str, Any]:
    data = trajectory.to_dict()
    if not include_tokens:
        data.pop("sequences", None)
    data["example"].pop("golden_answers", None)
    return data


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
        changes: dict[str, int] = {}
        if max_turns is not None:
            changes["max_turns"] = max_turns
        if top_n is not None:
            changes["top_n"] = top_n
        return replace(service.agent_config, **changes)

    @app.post("/v1/answer", summary="Answer a question with the agent")
    async def answer(request: AnswerRequest, http: fastapi.Request) -> Any:
        question = check_question(request.question)
        work = service.answer(question, agent_config(request.max_turns, request.top_n))
        trajectory = await unless_gone(http, work)
        return JSONResponse(
            {
                "answer": trajectory.answer,
                "end_reason": trajectory.end_reason,
                "error": trajectory.error,
                "turns": len(trajectory.turns),
                "searches": trajectory.num_searches,
                "trajectory": _trajectory_body(trajectory, request.include_tokens),
            }
        )

    @app.post("/v1/chat/completions", summary="OpenAI-style: the last user message is asked")
    async def chat(request: ChatRequest, http: fastapi.Request) -> Any:
        if request.stream:
            raise fastapi.HTTPException(400, "streaming is not supported; set stream to false")
        if len(request.messages) > config.max_messages:
            raise fastapi.HTTPException(422, f"at most {config.max_messages} messages")
        users = [m.content for m in request.messages if m.role == "user" and m.content]
        if not users:
            raise fastapi.HTTPException(422, "no user message with text content")
        work = service.answer(check_question(users[-1]), service.agent_config)
        trajectory = await unless_gone(http, work)
        prompt_tokens = sum(t.prompt_tokens for t in trajectory.turns)
        completion_tokens = sum(t.generated_tokens for t in trajectory.turns)
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
                        "finish_reason": "stop" if trajectory.answer is not None else "length",
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                },
                "memsearcher": {
                    "end_reason": trajectory.end_reason,
                    "error": trajectory.error,
                    "turns": len(trajectory.turns),
                    "searches": trajectory.num_searches,
                },
            }
        )

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
