"""The LLM protocol: token ids in, token ids out."""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard

from memsearcher.types import FinishReason


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one batch of prompts.

    Every backend draws from exactly softmax(logits / temperature) within the top-p nucleus
    (greedy at temperature 0), with every other logits processor off, whatever the checkpoint's
    generation_config or the server's defaults say (`NEUTRAL_PROCESSORS`): that is the
    distribution the trainer's log-probs model, and it makes backends agree.
    """

    max_new_tokens: int = 512
    """Generation budget per prompt."""
    temperature: float = 0.0
    """0 decodes greedily; otherwise sample at this temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass (only when sampling)."""
    stop: tuple[str, ...] = ()
    """Generation ends once the generated text contains one of these strings."""
    seed: int | None = None
    """Seed for sampling; None leaves the backend's random state alone."""

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.temperature >= 0:  # written so that NaN fails too
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


# The neutral value of each logits processor that checkpoints or servers switch on by default
# (Qwen2.5-Instruct's generation_config: repetition_penalty 1.05, top_k 20; llama.cpp's server:
# top_k 40, min_p 0.05). Names as vLLM's SamplingParams and the OpenAI-style servers take them.
NEUTRAL_PROCESSORS: dict[str, float] = {
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def derive_seed(seed: int, *parts: int) -> int:
    """A 63-bit seed for the stream named by ``parts`` (step, rank, call, row, ...) under
    ``seed``: a hash, so streams never overlap the way ``seed + rank + call`` ones do."""
    text = ",".join(str(int(p)) for p in (seed, *parts))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1


@dataclass(frozen=True)
class Completion:
    """What the model generated for one prompt.

    ``token_ids`` ends with the end-of-sequence token when the model stopped by itself, or with
    the token that completed a stop string; the stop string stays in the output.
    """

    token_ids: tuple[int, ...]
    finish_reason: FinishReason


class Tokenizer(Protocol):
    """The part of a tokenizer the agents need."""

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with no special tokens added."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """The exact text of ``ids``, special tokens included."""
        ...

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
        """The model's chat template applied to ``messages``, as text."""
        ...

    def encode_chat(
        self,
        messages: Sequence[dict[str, str]],
        add_generation_prompt: bool,
        after: int | None = None,
    ) -> list[int]:
        """Token ids of ``render_chat(messages)``: the template's special tokens are special, and
        special tokens written in the messages stay text; ``after=k``: only what follows message
        k's content."""
        ...


class LLM(Protocol):
    """A text generator over token ids; batching is the backend's business."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_context_tokens(self) -> int:
        """The longest prompt plus generation the model supports."""
        ...

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Completion]: ...


class AsyncLLM(Protocol):
    """An LLM that generates for one prompt at a time, concurrently (an HTTP backend): what
    the async driver runs."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_context_tokens(self) -> int: ...

    async def agenerate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion: ...


def is_async(llm: Any) -> TypeGuard[AsyncLLM]:
    """Whether ``llm`` has an async ``agenerate`` (checked without touching its properties,
    which for an HTTP backend may ask its server)."""
    return inspect.iscoroutinefunction(getattr(llm, "agenerate", None))
