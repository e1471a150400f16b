"""A model folder's tokenizer as the `Tokenizer` protocol (transformers imported on use)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from memsearcher.errors import MemSearcherError
from memsearcher.llm.base import Tokenizer

__all__ = ["load_tokenizer"]


def load_tokenizer(path: str, chat_template_kwargs: Mapping[str, Any] | None = None) -> Tokenizer:
    """A model folder's tokenizer, with the EOS ids of its generation config;
    ``chat_template_kwargs`` go to its chat template (`HFTokenizer`)."""
    from transformers import AutoTokenizer, GenerationConfig

    from memsearcher.llm.hf import HFTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as error:
        raise MemSearcherError(f"cannot load the tokenizer of {path!r}: {error}") from error
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:
        eos = None
    extra = [eos] if isinstance(eos, int) else list(eos or [])
    return HFTokenizer(tokenizer, extra, chat_template_kwargs)
