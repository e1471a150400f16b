"""LLM backends behind one small protocol."""

from __future__ import annotations

from typing import Any

from memsearcher.errors import MemSearcherError
from memsearcher.llm.base import LLM, Completion, SamplingParams, Tokenizer

__all__ = ["LLM", "Completion", "SamplingParams", "Tokenizer", "load_llm"]


def load_llm(
    spec: str = "embedded",
    device: str = "auto",
    batch_size: int = 32,
    backend: str = "hf",
    **options: Any,
) -> LLM:
    """Open a model: ``embedded`` (the packaged SmolLM2), an HF folder, or a hub id.

    ``backend`` is ``hf`` (transformers, in process), ``openai`` (an OpenAI-compatible server
    at ``base_url``; ``spec`` or ``tokenizer`` names the local tokenizer) or ``vllm``.
    """
    from memsearcher.llm.embedded import embedded_model_path

    path = str(embedded_model_path()) if spec == "embedded" else spec
    if backend == "hf":
        from memsearcher.llm.hf import HFModel

        return HFModel.from_pretrained(path, device=device, batch_size=batch_size)
    raise MemSearcherError(f"unknown backend {backend!r}; choose one of: hf")
