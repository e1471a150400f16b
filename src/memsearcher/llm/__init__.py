"""LLM backends behind one small protocol."""

from __future__ import annotations

from typing import Any

from memsearcher.errors import MemSearcherError
from memsearcher.llm.base import LLM, Completion, SamplingParams, Tokenizer
from memsearcher.llm.tokenizer import load_tokenizer

__all__ = ["LLM", "Completion", "SamplingParams", "Tokenizer", "load_llm", "load_tokenizer"]


def load_llm(
    spec: str = "embedded",
    device: str = "auto",
    batch_size: int = 32,
    backend: str = "hf",
    **options: Any,
) -> LLM:
    """Open a model: ``embedded`` (the packaged SmolLM2 with its protocol adapter),
    ``embedded-base`` (the raw SmolLM2), an HF folder, or a hub id.

    ``backend`` is ``hf`` (transformers, in process), ``openai`` (an OpenAI-compatible server
    at ``base_url``; ``spec`` or ``tokenizer`` names the local tokenizer) or ``vllm``.
    """
    from memsearcher.llm.embedded import resolve_model

    path = resolve_model(spec)
    if backend == "hf":
        from memsearcher.llm.hf import HFModel

        return HFModel.from_pretrained(path, device=device, batch_size=batch_size)
    if backend == "openai":
        from memsearcher.llm.openai_http import OpenAIHTTPModel

        if not options.get("base_url"):
            raise MemSearcherError("--backend openai needs --base-url (the server's /v1 URL)")
        tokenizer_path = options.get("tokenizer") or path
        return OpenAIHTTPModel(
            options["base_url"],
            load_tokenizer(tokenizer_path),
            model=options.get("served_model"),
            api=options.get("api", "auto"),
            concurrency=options.get("concurrency", 64),
            max_context_tokens=options.get("max_context_tokens"),
        )
    if backend == "vllm":
        from memsearcher.llm.vllm import VLLMModel

        return VLLMModel.from_pretrained(path, gpu_memory=options.get("gpu_memory", 0.85))
    raise MemSearcherError(f"unknown backend {backend!r}; choose one of: hf, openai, vllm")
