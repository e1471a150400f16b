"""LLM backends behind one small protocol."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memsearcher.errors import MemSearcherError
from memsearcher.llm.base import LLM, Completion, SamplingParams, Tokenizer
from memsearcher.llm.tokenizer import load_tokenizer

__all__ = [
    "BACKENDS",
    "LLM",
    "Completion",
    "SamplingParams",
    "Tokenizer",
    "load_llm",
    "load_tokenizer",
]


def _hf(path: str, device: str, batch_size: int, options: dict[str, Any]) -> LLM:
    from memsearcher.llm.hf import HFModel

    return HFModel.from_pretrained(
        path,
        device=device,
        batch_size=batch_size,
        chat_template_kwargs=options.get("chat_template_kwargs"),
    )


def _openai(path: str, device: str, batch_size: int, options: dict[str, Any]) -> LLM:
    from memsearcher.llm.openai_http import OpenAIHTTPModel

    if not options.get("base_url"):
        raise MemSearcherError("--backend openai needs --base-url (the server's /v1 URL)")
    return OpenAIHTTPModel(
        options["base_url"],
        load_tokenizer(options.get("tokenizer") or path, options.get("chat_template_kwargs")),
        model=options.get("served_model"),
        api=options.get("api", "auto"),
        concurrency=options.get("concurrency", 64),
        max_context_tokens=options.get("max_context_tokens"),
    )


def _vllm(path: str, device: str, batch_size: int, options: dict[str, Any]) -> LLM:
    from memsearcher.llm.vllm import VLLMModel

    return VLLMModel.from_pretrained(
        path,
        gpu_memory=options.get("gpu_memory", 0.85),
        chat_template_kwargs=options.get("chat_template_kwargs"),
    )


BACKENDS: dict[str, Callable[[str, str, int, dict[str, Any]], LLM]] = {
    "hf": _hf,
    "openai": _openai,
    "vllm": _vllm,
}
"""Each backend's loader: the model's path (or hub id), device, batch size, and its options."""


def load_llm(
    spec: str = "embedded",
    device: str = "auto",
    batch_size: int = 32,
    backend: str = "hf",
    **options: Any,
) -> LLM:
    """Open a model: a packaged SmolLM2 (``embedded``, the default agent, and the other
    names of `memsearcher.llm.embedded.MODELS`), an HF folder, or a hub id.

    ``backend`` is a key of `BACKENDS`: ``hf`` (transformers, in process), ``openai`` (an
    OpenAI-compatible server at ``base_url``; ``spec`` or ``tokenizer`` names the local
    tokenizer) or ``vllm``. ``chat_template_kwargs`` (an option of every backend) go to the
    tokenizer's chat template, e.g. ``{"enable_thinking": False}`` for Qwen3.
    """
    from memsearcher.llm.embedded import resolve_model

    if backend not in BACKENDS:
        raise MemSearcherError(f"unknown backend {backend!r}; choose one of {sorted(BACKENDS)}")
    return BACKENDS[backend](resolve_model(spec), device, batch_size, options)
