"""An LLM behind an OpenAI-compatible HTTP server (vLLM, SGLang, llama.cpp, llama-cpp-python).

The agents build token ids, so the model's tokenizer lives here, on the client: prompts go to
``/v1/completions`` as token ids (token-exact: the server sees exactly what a training run
sees). A server that only takes text prompts (llama-cpp-python) gets the decoded prompt, and
one without ``/v1/completions`` gets ``/v1/chat/completions`` with the conversation parsed back
out of the ChatML prompt (Qwen2.5, SmolLM2); neither of those is token-exact, and a warning
says so once.

Every request runs on its own: ``agenerate`` is what the async driver calls, and the server
batches whatever is in flight. ``generate`` (the `LLM` protocol) sends a batch concurrently.
A semaphore bounds the requests in flight; connection failures, timeouts, 408, 429 and 5xx
answers are retried with exponential backoff.

The output is mapped back onto `Completion`'s contract (the stop string stays in the output,
EOS ends a completion that stopped by itself): exactly from ``token_ids`` and ``stop_reason``
where the server returns them (vLLM), otherwise from the text and the usage counts.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from memsearcher.errors import MemSearcherError
from memsearcher.llm.base import (
    NEUTRAL_PROCESSORS,
    Completion,
    SamplingParams,
    Tokenizer,
    derive_seed,
)
from memsearcher.text import sanitize_text
from memsearcher.types import FinishReason

logger = logging.getLogger(__name__)

__all__ = ["OpenAIHTTPError", "OpenAIHTTPModel", "parse_chatml", "to_completion"]

_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_CHATML = re.compile(r"<\|im_start\|>(\w+)\n(.*?)(?:<\|im_end\|>\n?|$)", re.DOTALL)
T = TypeVar("T")


class OpenAIHTTPError(MemSearcherError):
    """The server could not be reached, or refused a request."""


def parse_chatml(text: str) -> list[dict[str, str]]:
    """The messages of a ChatML prompt; the open assistant turn at the end is left out."""
    messages = [{"role": role, "content": body} for role, body in _CHATML.findall(text)]
    if not messages:
        raise OpenAIHTTPError(
            "chat mode needs a ChatML chat template (<|im_start|>role ... <|im_end|>); "
            "use a server with /v1/completions instead"
        )
    if messages[-1]["role"] == "assistant" and not messages[-1]["content"].strip():
        messages.pop()
    return messages


def _api_root(url: str) -> str:
    url = url.rstrip("/")
    for suffix in ("/completions", "/chat/completions", "/chat"):
        if url.endswith(suffix):
            url = url[: -len(suffix)]
    return url if url.endswith("/v1") else url + "/v1"


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run ``coroutine`` to its end from synchronous code, even inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coroutine)
        except BaseException as error:  # handed to the caller's thread
            box["error"] = error

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    value: T = box["value"]
    return value


class OpenAIHTTPModel:
    """``OpenAIHTTPModel("http://127.0.0.1:8000/v1", tokenizer)``: an `LLM` and an async LLM."""

    def __init__(
        self,
        base_url: str,
        tokenizer: Tokenizer,
        *,
        model: str | None = None,
        api: str = "auto",
        max_context_tokens: int | None = None,
        concurrency: int = 64,
        timeout: float = 600.0,
        retries: int = 4,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
    ) -> None:
        try:
            import httpx
        except ImportError:
            raise MemSearcherError(
                "the HTTP backend needs httpx: pip install 'memsearcher[server]'"
            ) from None
        if api not in ("auto", "completions", "chat"):
            raise MemSearcherError(f"api must be auto, completions or chat, not {api!r}")
        if concurrency < 1:
            raise MemSearcherError(f"concurrency must be >= 1, got {concurrency}")
        self._httpx = httpx
        self.base_url = _api_root(base_url)
        self._tokenizer = tokenizer
        self.api = api
        self.concurrency = concurrency
        self.timeout = httpx.Timeout(timeout, connect=min(timeout, 10.0))
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        self.token_prompts = True
        """False once the server refused a token-id prompt: text prompts from then on."""
        self._token_prompts_work = False
        self._clients: dict[int, tuple[Any, asyncio.Semaphore]] = {}
        self._warned = False
        served = self._models()
        if model is None:
            if not served:
                raise OpenAIHTTPError(f"{self.base_url}/models lists no model; pass a name")
            model = str(served[0]["id"])
        self.model = model
        info = next((m for m in served if m.get("id") == model), {})
        self._max_context = max_context_tokens or int(
            info.get("max_model_len") or info.get("context_length") or 32768
        )

    # -- the LLM protocol ---------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def max_context_tokens(self) -> int:
        return self._max_context

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Completion]:
        """All prompts at once, concurrently; prompt i samples with its own seed."""

        async def run_all() -> list[Completion]:
            try:
                return list(
                    await asyncio.gather(
                        *(
                            self.agenerate(p, replace(params, seed=_seed(params.seed, i)))
                            for i, p in enumerate(prompts)
                        )
                    )
                )
            finally:
                await self.aclose()

        return run_sync(run_all())

    async def agenerate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        """One completion; at most ``concurrency`` requests are in flight per event loop."""
        if not prompt_ids:
            raise ValueError("cannot generate from an empty prompt")
        client, gate = self._client()
        async with gate:
            if self.api != "chat":
                choice, usage = await self._complete(client, prompt_ids, params)
                if choice is not None:
                    return self._completion(choice, usage, params, choice.get("text", ""))
            choice, usage = await self._chat(client, prompt_ids, params)
            content = (choice.get("message") or {}).get("content") or ""
            return self._completion(choice, usage, params, content)

    async def aclose(self) -> None:
        """Close this event loop's connection pool."""
        entry = self._clients.pop(id(asyncio.get_running_loop()), None)
        if entry is not None:
            await entry[0].aclose()

    # -- requests ---------------------------------------------------------------------------

    def _client(self) -> tuple[Any, asyncio.Semaphore]:
        # an httpx.AsyncClient belongs to the event loop that created it
        key = id(asyncio.get_running_loop())
        if key not in self._clients:
            limits = self._httpx.Limits(max_connections=self.concurrency)
            client = self._httpx.AsyncClient(timeout=self.timeout, limits=limits)
            self._clients[key] = (client, asyncio.Semaphore(self.concurrency))
        return self._clients[key]

    def _models(self) -> list[dict[str, Any]]:
        try:
            response = self._httpx.get(f"{self.base_url}/models", timeout=self.timeout)
        except self._httpx.TransportError as error:
            raise OpenAIHTTPError(f"cannot reach {self.base_url}: {error}") from None
        if response.status_code != 200:
            return []
        data = response.json().get("data") or []
        return [m for m in data if isinstance(m, dict)]

    async def _post(
        self,
        client: Any,
        path: str,
        payload: dict[str, Any],
        retry_status: frozenset[int] = _RETRY_STATUS,
    ) -> Any:
        """POST with retries; returns the response, which may be a non-retryable 4xx."""
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                cap = min(self.max_backoff, self.backoff * 2 ** (attempt - 1))
                await asyncio.sleep(random.uniform(cap / 2, cap))  # full jitter
            try:
                response = await client.post(f"{self.base_url}{path}", json=payload)
            except self._httpx.TransportError as error:
                last = f"{type(error).__name__}: {error}"
                continue
            if response.status_code in retry_status:
                last = f"HTTP {response.status_code}: {response.text[:200]}"
                continue
            return response
        raise OpenAIHTTPError(
            f"{self.base_url}{path}: no answer after {self.retries + 1} tries: {last}"
        )

    def _sampling(self, params: SamplingParams) -> dict[str, Any]:
        payload: dict[str, Any] = {
            "model": self.model,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            # the server's own defaults off (llama.cpp spells the penalty repeat_penalty)
            **NEUTRAL_PROCESSORS,
            "repeat_penalty": 1.0,
        }
        if params.stop:
            payload["stop"] = list(params.stop)
        if params.seed is not None:
            payload["seed"] = params.seed % 2**31  # servers take 32-bit signed seeds
        return payload

    async def _complete(
        self, client: Any, prompt_ids: Sequence[int], params: SamplingParams
    ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
        """``/v1/completions``; (None, {}) when the server has no such endpoint (auto mode)."""
        payload = self._sampling(params)
        # vLLM and SGLang: keep the stop string, and return the generated token ids
        payload.update(include_stop_str_in_output=True, return_token_ids=True)
        # the sampled tokens' text, stop string included, from servers that cut it from "text"
        payload["logprobs"] = 0
        while True:
            probing = self.token_prompts and not self._token_prompts_work
            payload["prompt"] = (
                list(prompt_ids) if self.token_prompts else self._tokenizer.decode(prompt_ids)
            )
            # the first token-id prompt is not retried: a refusal is an answer, not a fault
            retry = frozenset() if probing else _RETRY_STATUS
            response = await self._post(client, "/completions", payload, retry)
            if response.status_code in (404, 405) and self.api == "auto":
                self._warn(
                    "the server has no /v1/completions; using chat, which is not token-exact"
                )
                self.api = "chat"
                return None, {}
            if probing and _refused_token_prompt(response):
                self._warn("the server refused token-id prompts; sending text, not token-exact")
                self.token_prompts = False
                continue
            data = self._json(response, "/completions")
            self._token_prompts_work = self.token_prompts
            return self._first_choice(data, "/completions"), data.get("usage") or {}

    async def _chat(
        self, client: Any, prompt_ids: Sequence[int], params: SamplingParams
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        payload = self._sampling(params)
        payload["messages"] = parse_chatml(self._tokenizer.decode(prompt_ids))
        response = await self._post(client, "/chat/completions", payload)
        data = self._json(response, "/chat/completions")
        return self._first_choice(data, "/chat/completions"), data.get("usage") or {}

    def _json(self, response: Any, path: str) -> dict[str, Any]:
        if response.status_code >= 400:
            raise OpenAIHTTPError(
                f"{self.base_url}{path} refused the request: HTTP {response.status_code} "
                f"{response.text[:300]}"
            )
        try:
            data = response.json()
        except ValueError:
            raise OpenAIHTTPError(f"{self.base_url}{path} answered non-JSON") from None
        if not isinstance(data, dict):
            raise OpenAIHTTPError(f"{self.base_url}{path} answered {type(data).__name__}")
        return data

    def _first_choice(self, data: dict[str, Any], path: str) -> dict[str, Any]:
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise OpenAIHTTPError(f"{self.base_url}{path} answered without choices")
        choice: dict[str, Any] = choices[0]
        return choice

    def _warn(self, message: str) -> None:
        if not self._warned:
            logger.warning("%s: %s", self.base_url, message)
            self._warned = True

    def _completion(
        self, choice: dict[str, Any], usage: dict[str, Any], params: SamplingParams, text: str
    ) -> Completion:
        return to_completion(choice, usage, params, text, self._tokenizer)


def to_completion(
    choice: dict[str, Any],
    usage: dict[str, Any],
    params: SamplingParams,
    text: str,
    tokenizer: Tokenizer,
) -> Completion:
    """One OpenAI choice as a `Completion`: the stop string kept, EOS closing a natural stop."""
    text = sanitize_text(text if isinstance(text, str) else "")
    finish: FinishReason = "length" if choice.get("finish_reason") == "length" else "stop"
    eos = min(tokenizer.eos_token_ids) if tokenizer.eos_token_ids else None
    ids = choice.get("token_ids")
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        # exact: the server's own tokens (vLLM); they end with EOS when it stopped by itself
        tokens = tuple(ids)
        by_string = any(s in text for s in params.stop)
        ends_with_eos = tokens[-1] in tokenizer.eos_token_ids
        if finish == "stop" and not by_string and not ends_with_eos and eos is not None:
            tokens += (eos,)
        return Completion(tokens, finish)
    if finish == "length":
        return Completion(tuple(tokenizer.encode(text)), "length")
    # the text of every generated token, where the server lists them (logprobs): it still
    # holds a stop string that a server such as llama-cpp-python cut from "text"
    logprobs = choice.get("logprobs")
    pieces = logprobs.get("tokens") if isinstance(logprobs, dict) else None
    if isinstance(pieces, list) and all(isinstance(p, str) for p in pieces):
        full = "".join(pieces)
        if full.startswith(text) and len(full) > len(text):
            text = full
    ends = [text.index(stop) + len(stop) for stop in params.stop if stop in text]
    if ends:  # the stop string stays in the output
        return Completion(tuple(tokenizer.encode(text[: min(ends)])), "stop")
    stop_string = _stripped_stop(choice, usage, params, text, tokenizer)
    if stop_string is not None:
        return Completion(tuple(tokenizer.encode(text + stop_string)), "stop")
    tokens = tuple(tokenizer.encode(text))
    return Completion(tokens + ((eos,) if eos is not None else ()), "stop")


def _stripped_stop(
    choice: dict[str, Any],
    usage: dict[str, Any],
    params: SamplingParams,
    text: str,
    tokenizer: Tokenizer,
) -> str | None:
    """The stop string a server cut from ``text``, or None if the model stopped by itself."""
    if not params.stop:
        return None
    reason = choice.get("stop_reason")
    if isinstance(reason, str) and reason in params.stop:
        return reason
    if "stop_reason" in choice:  # the server says why, and it was not a stop string
        return None
    # llama-cpp-python says nothing; its usage counts the stop string's tokens but not the
    # EOS token, so a count above the text's own tokens means a stop string was cut.
    generated = usage.get("completion_tokens")
    if not isinstance(generated, int) or generated <= len(tokenizer.encode(text)):
        return None
    for stop in params.stop:
        if len(tokenizer.encode(text + stop)) == generated:
            return stop
    return params.stop[0]


def _refused_token_prompt(response: Any) -> bool:
    """Did the server reject a token-id prompt? A 400/422, or the 500 that llama-cpp-python
    answers with for a request that fails its validation."""
    if response.status_code in (400, 422):
        return True
    text = response.text[:2000].lower()
    return response.status_code == 500 and "prompt" in text and "valid" in text


def _seed(seed: int | None, index: int) -> int | None:
    # distinct per prompt, so that a group of identical prompts does not sample identically
    return None if seed is None else derive_seed(seed, index)
