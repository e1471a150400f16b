"""LLM backends behind one small protocol."""

from __future__ import annotations

from memsearcher.llm.base import LLM, Completion, SamplingParams, Tokenizer

__all__ = ["LLM", "Completion", "SamplingParams", "Tokenizer", "load_llm"]


def load_llm(spec: str = "embedded", device: str = "auto", batch_size: int = 32) -> LLM:
    """Open a model: ``embedded`` (the packaged SmolLM2), an HF folder, or a hub id."""
    from memsearcher.llm.embedded import embedded_model_path
    from memsearcher.llm.hf import HFModel

    path = str(embedded_model_path()) if spec == "embedded" else spec
    return HFModel.from_pretrained(path, device=device, batch_size=batch_size)
