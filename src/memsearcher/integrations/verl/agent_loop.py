"""Our agents as a veRL agent loop (veRL >= 0.9, V1 trainer).

veRL builds one loop object per trajectory, from the agent-loop YAML (``hydra.utils.
instantiate`` with its wrappers) inside each ``AgentLoopWorker``, and awaits ``run(**row)``.
The loop starts one of our episodes (any agent in ``memsearcher.agent.AGENTS``) and drives it
with the same protocol loop as our async driver (``agent.async_driver.drive``): generations go
to veRL's ``server_manager.generate`` (token ids in, ``TokenOutput`` out: vLLM or SGLang with
weight sync), actions to the environment (``agent.tasks.ENVIRONMENTS``): searches to our
retrieval server over HTTP or to an in-process index; the shop's actions to the generated shop
in process, or to a WebShop server. Prompts, parsing and loss masks are the episode's own. It
returns one ``AgentLoopOutput`` per turn sequence (``outputs.turn_rows``), the last carrying
our reward (the graded one, or the shop's), so veRL skips its own reward step and its
multi-trajectory GRPO broadcasts each trajectory's advantage to its rows.

Things that live as long as the worker process (the index, the HTTP client, the tokenizer
wrapper) are made once and shared by every loop object; per event loop where they must be.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
)

from memsearcher.agent import AgentConfig, Generate
from memsearcher.agent.async_driver import drive
from memsearcher.agent.base import check_trainable
from memsearcher.agent.environments import (
    Action,
    AsyncEnvironment,
    BatchedSearch,
    DirectSearch,
    Observation,
)
from memsearcher.agent.prompts import read_templates
from memsearcher.agent.tasks import environment_kind
from memsearcher.errors import MemSearcherError
from memsearcher.integrations.verl.checks import check_trainer_config
from memsearcher.integrations.verl.data import example_from_row
from memsearcher.integrations.verl.outputs import finish_reason, turn_rows
from memsearcher.llm.base import Completion, Tokenizer
from memsearcher.llm.hf import HFTokenizer
from memsearcher.rl.rewards import get_reward

__all__ = ["MemSearcherAgentLoop"]

logger = logging.getLogger(__name__)

ActFn = Callable[[Any], Awaitable[Any]]
"""An environment's ``act_one``: an action in, its observation out (`drive`'s ``act``)."""

_PROCESS: dict[Any, Any] = {}
"""Made once per worker process: indexes, tokenizer wrappers, context limits."""
_PER_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Any, Any]] = (
    weakref.WeakKeyDictionary()
)
"""Made once per event loop: HTTP clients and search batchers are bound to their loop."""


def _once(key: Any, make: Callable[[], Any]) -> Any:
    if key not in _PROCESS:
        _PROCESS[key] = make()
    return _PROCESS[key]


def _tokenizer(
    hf_tokenizer: Any, model_path: str, chat_template_kwargs: Mapping[str, Any]
) -> HFTokenizer:
    """The episodes' tokenizer, stopping on the EOS ids vLLM stops on: the tokenizer's and
    those of the model's ``generation_config.json`` (Qwen2.5 lists two), and rendering chats
    with veRL's ``data.apply_chat_template_kwargs`` (Qwen3's ``enable_thinking``)."""
    kwargs = {str(k): v for k, v in chat_template_kwargs.items()}

    def make() -> tuple[Any, HFTokenizer]:
        from transformers import GenerationConfig

        try:
            eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        except (OSError, ValueError) as error:
            logger.warning(
                "no generation config at %s (%s): EOS from the tokenizer", model_path, error
            )
            eos = None
        extra = [eos] if isinstance(eos, int) else list(eos or [])
        return hf_tokenizer, HFTokenizer(hf_tokenizer, extra, kwargs)  # the reference pins id()

    key = ("tokenizer", id(hf_tokenizer), model_path, repr(sorted(kwargs.items())))
    wrapper: HFTokenizer = _once(key, make)[1]
    return wrapper


def _max_context(rollout: Any, model_path: str) -> int | None:
    """The context the rollout server allows: ``rollout.max_model_len``, else the model's
    ``max_position_embeddings`` (what veRL's vLLM server falls back to)."""
    if rollout.get("max_model_len") is not None:
        return int(rollout.max_model_len)

    def make() -> int | None:
        from transformers import AutoConfig

        try:
            positions = getattr(
                AutoConfig.from_pretrained(model_path), "max_position_embeddings", None
            )
        except (OSError, ValueError):
            return None
        return int(positions) if positions else None

    limit: int | None = _once(("max_context", model_path), make)
    return limit


def _searcher(spec: str | None) -> ActFn:
    """Search through a retrieval server (an ``http(s)://`` URL: every worker on every node
    shares it, and it batches) or an index opened once per process (an index folder, or None
    for the embedded BM25), whose searches are merged into batches on one worker thread."""
    per_loop = _PER_LOOP.setdefault(asyncio.get_running_loop(), {})
    if spec in per_loop:
        search: ActFn = per_loop[spec]
        return search
    if spec is not None and spec.startswith(("http://", "https://")):
        from memsearcher.retrieval.client import AsyncHTTPRetriever

        search = DirectSearch(AsyncHTTPRetriever(spec)).act_one
    else:
        from memsearcher.retrieval import open_retriever

        batcher = BatchedSearch(_once(("index", spec), lambda: open_retriever(spec)))
        batcher.start()  # lives as long as the worker's event loop
        search = batcher.act_one
    per_loop[spec] = search
    return search


def _shop_opener(
    environment: str,
    shop: Mapping[str, Any] | None,
    ids_from: int | None,
    repeat_ends: bool,
    webshop_url: str | None,
) -> Callable[[], AsyncEnvironment[Any, Any]]:
    """A fresh shop environment for each trajectory, so that the sessions of the trajectories
    in flight (a group's, of one instruction) are each their own; what they share is made once
    per process: the generated catalogue and its search (``environment: shop``, ``shop`` being
    `ShopConfig` fields, ``ids_from`` and ``repeat_ends`` GRPO's ``shop_ids_from`` and
    ``shop_repeat_ends``), or the HTTP connections to ``webshop_url`` (``environment:
    webshop``)."""
    from memsearcher.agent.environments.shop import ShopEnvironment, ShopSearch
    from memsearcher.agent.environments.shop_world import ShopConfig
    from memsearcher.agent.environments.webshop_client import WebShopEnvironment
    from memsearcher.agent.tasks import shop_catalogue

    if environment == "webshop":
        if not webshop_url:
            raise MemSearcherError("environment: webshop needs webshop_url")
        pool = _once(("webshop", webshop_url), lambda: WebShopEnvironment(webshop_url))
        return lambda: WebShopEnvironment(webshop_url, client=pool.http)  # lent: stays open
    try:
        config = ShopConfig(**dict(shop or {}))
    except (TypeError, ValueError) as error:
        raise MemSearcherError(f"shop: {error}") from None

    def make() -> tuple[Any, Any]:
        catalogue = shop_catalogue(config, ids_from)
        return catalogue, ShopSearch(catalogue.products)

    catalogue, search = _once(("shop", repr(config), ids_from), make)
    return lambda: ShopEnvironment(catalogue, search, repeat_ends=repeat_ends)


def _agent_config(values: Mapping[str, Any] | None) -> AgentConfig:
    known = {f.name for f in dataclasses.fields(AgentConfig)}
    values = dict(values or {})
    unknown = sorted(set(values) - known)
    if unknown:
        raise MemSearcherError(f"agent_config: unknown keys {unknown}; known: {sorted(known)}")
    try:
        config = AgentConfig(**values)
    except (TypeError, ValueError) as error:
        raise MemSearcherError(f"agent_config: {error}") from None
    check_trainable(config, "agent_config")  # veRL trains on every generated token
    return config


class _Generations:
    """Our ``Generate`` requests through veRL's server manager, keeping what the rows need:
    each call's log-probs, the weight versions used, and the time spent."""

    def __init__(
        self, server_manager: Any, sampling_params: Mapping[str, Any], tokenizer: Tokenizer,
        extra_kwargs: Mapping[str, Any],
    ) -> None:  # fmt: skip
        self.server_manager = server_manager
        self.sampling_params = dict(sampling_params)
        self.tokenizer = tokenizer
        self.extra_kwargs = dict(extra_kwargs)
        # one id per trajectory: veRL's load balancer keeps a request id on one server, whose
        # prefix cache then holds the trajectory's context
        self.request_id = uuid4().hex
        self.logprobs: list[list[float]] | None = []
        self.fields: dict[str, Any] = {}
        self.preempted = 0
        self.seconds = 0.0

    async def __call__(self, request: Generate) -> Completion:
        params = {**self.sampling_params, "max_tokens": request.max_new_tokens}
        if request.stop:
            params["stop"] = list(request.stop)
        start = time.perf_counter()
        output = await self.server_manager.generate(
            self.request_id,
            prompt_ids=list(request.prompt_ids),
            sampling_params=params,
            **self.extra_kwargs,
        )
        self.seconds += time.perf_counter() - start
        token_ids = [int(t) for t in output.token_ids]
        if not token_ids and output.stop_reason in ("aborted", "abort"):
            raise MemSearcherError("the rollout server aborted a generation and returned nothing")
        if self.logprobs is not None and output.log_probs is not None:
            self.logprobs.append([float(lp) for lp in output.log_probs])
        else:
            self.logprobs = None  # all or nothing: veRL stacks them over the batch
        # as veRL's ToolAgentLoop: the first call's fields (weight version, cache hits), then
        # the latest weight version; TransferQueue tags each row with min/max_global_steps
        fields = dict(output.extra_fields or {})
        if not self.fields:
            self.fields = fields
        elif fields.get("max_global_steps") is not None:
            self.fields["max_global_steps"] = fields["max_global_steps"]
        self.preempted += int(output.num_preempted or 0)
        return Completion(tuple(token_ids), finish_reason(token_ids, request.stop, self.tokenizer))


class MemSearcherAgentLoop(AgentLoopBase):
    """One of our agents on one question per ``run``; the YAML entry's keys are the arguments
    after veRL's own (see configs/verl/agent_loop.yaml).

    Args:
        agent: a key of ``memsearcher.agent.AGENTS`` (``memsearcher``, ``react``, ...).
        environment: a key of ``memsearcher.agent.tasks.ENVIRONMENTS``: ``search`` (the
            default), ``shop`` or ``webshop`` (configs/verl/agent_loop_shop.yaml).
        retriever: search: a retrieval server URL, an index folder, or None for the embedded
            BM25.
        shop: shop: `ShopConfig` fields (``seed``, ``families_per_category``, ...).
        shop_ids_from, shop_repeat_ends: shop: as the RL config's fields of those names.
        webshop_url: webshop: the server.
        agent_config: ``AgentConfig`` fields (``max_turns``, ``memory_tokens``, ...).
        templates: a YAML/JSON file overriding prompt templates (the environment's), or None.
        reward: a key of ``memsearcher.rl.rewards.REWARDS``: ``environment`` for the shops,
            an answer reward for search.
    """

    def __init__(
        self,
        *args: Any,
        agent: str = "memsearcher",
        environment: str = "search",
        retriever: str | None = None,
        shop: Mapping[str, Any] | None = None,
        shop_ids_from: int | None = None,
        shop_repeat_ends: bool = False,
        webshop_url: str | None = None,
        agent_config: Mapping[str, Any] | None = None,
        templates: str | None = None,
        reward: str = "graded",
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        check_trainer_config(self.config)
        model_path = str(self.config.actor_rollout_ref.model.path)
        self.agent = agent
        self.retriever = retriever
        self.agent_config = _agent_config(agent_config)
        kind = environment_kind(environment)
        if kind.own_reward != (reward == "environment"):
            rule = "environment" if kind.own_reward else "an answer reward"
            raise MemSearcherError(f"reward: {reward!r} with environment {environment}: use {rule}")
        shops = {"shop": shop, "shop_ids_from": shop_ids_from, "webshop_url": webshop_url}
        given = shops if environment == "search" else {"retriever": retriever}
        stray = [key for key, value in given.items() if value is not None]
        if stray:  # a setting the environment would ignore
            raise MemSearcherError(f"environment {environment} takes no {', '.join(stray)}")
        self.start_episodes = kind.start_episodes
        self.open_shop = (
            None
            if environment == "search"
            else _shop_opener(environment, shop, shop_ids_from, shop_repeat_ends, webshop_url)
        )
        self.templates = _once(
            ("templates", environment, templates),
            lambda: read_templates(templates, kind.templates),
        )
        try:
            self.reward = get_reward(reward)
        except ValueError as error:
            raise MemSearcherError(str(error)) from None
        self.agent_tokenizer = _tokenizer(
            self.tokenizer, model_path, self.apply_chat_template_kwargs or {}
        )
        self.max_context = _max_context(self.rollout_config, model_path)

    # veRL's base declares one output; its V1 worker (agent_loop_tq.py) also takes a list
    async def run(  # type: ignore[override, unused-ignore]
        self, sampling_params: dict[str, Any], **kwargs: Any
    ) -> list[AgentLoopOutput]:
        example = example_from_row(kwargs, needs_gold=self.open_shop is None)
        episode = self.start_episodes(
            self.agent, [example], self.agent_tokenizer, self.agent_config, self.templates,
            self.max_context,
        )[0]  # fmt: skip
        extra = {"priority": int(kwargs["priority"])} if "priority" in kwargs else {}
        generate = _Generations(self.server_manager, sampling_params, self.agent_tokenizer, extra)
        # a shop's environment is the trajectory's own; a search backend, the worker's
        act_once = _searcher(self.retriever) if self.open_shop is None else self.open_shop().act_one
        acting = [0.0]

        async def act(action: Action) -> Observation:
            start = time.perf_counter()
            try:
                return await act_once(action)
            finally:
                acting[0] += time.perf_counter() - start

        trajectory = await drive(episode, generate, act)
        rows = turn_rows(trajectory, generate.logprobs, self.reward, extra=generate.fields)
        outputs = [AgentLoopOutput(**row, metrics=AgentLoopMetrics()) for row in rows]
        # the trajectory's times go on its last row, so that sums over rows stay right
        outputs[-1].metrics = AgentLoopMetrics(
            generate_sequences=generate.seconds,
            tool_calls=acting[0],
            num_preempted=generate.preempted,
        )
        return outputs
