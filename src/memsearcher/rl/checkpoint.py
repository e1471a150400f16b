"""Checkpoints: weights in safetensors (HF ``save_pretrained``), plus optimizer, scheduler,
RNG and data-order state, written atomically.

A checkpoint is ``OUTPUT/step-N/``: it is written under a temporary name and renamed once
complete, so a crash never leaves a half-written ``step-N``. Every rank saves its own RNG state;
rank 0 writes everything else. An FSDP model's shards are gathered first, so its checkpoint is
the same whole-model folder as a single process writes.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memsearcher.errors import MemSearcherError
from memsearcher.rl.runtime import Runtime, barrier, full_state, is_sharded, load_full_state, unwrap

__all__ = ["latest_checkpoint", "load_checkpoint", "resume_step", "save_checkpoint"]

_STEP = re.compile(r"^step-(\d+)$")


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step, or None."""
    folder = Path(output_dir)
    if not folder.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _STEP.match(p.name))]
    found = [(step, p) for step, p in found if (p / "state.json").is_file()]
    return max(found)[1] if found else None


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    model: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: dict[str, Any],
    runtime: Runtime,
) -> Path:
    """Write ``OUTPUT/step-{step}`` (every rank must call this) and return its path."""
    final = Path(output_dir) / f"step-{step}"
    staging = Path(output_dir) / f".step-{step}.tmp"
    if runtime.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier(runtime)
    torch.save(_rng_state(), staging / f"rng-rank{runtime.rank}.pt")
    weights, optim = full_state(model, optimizer) if is_sharded(model) else (None, None)
    if runtime.is_main:
        model = unwrap(model)
        model.save_pretrained(staging / "model", state_dict=weights, safe_serialization=True)
        tokenizer.save_pretrained(staging / "model")
        torch.save(optim or optimizer.state_dict(), staging / "optimizer.pt")
        torch.save(scheduler.state_dict(), staging / "scheduler.pt")
    barrier(runtime)
    if runtime.is_main:
        # state.json last: latest_checkpoint treats a folder without it as incomplete.
        state = {**state, "step": step, "world_size": runtime.world_size}
        (staging / "state.json").write_text(json.dumps(state, indent=2), encoding="utf-8")
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
    barrier(runtime)
    return final


def load_checkpoint(
    folder: str | Path,
    model: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    runtime: Runtime,
) -> dict[str, Any]:
    """Restore weights, optimizer, scheduler and this rank's RNG; return the saved state."""
    folder = Path(folder)
    state_file = folder / "state.json"
    if not state_file.is_file():
        raise MemSearcherError(f"{folder} is not a complete checkpoint (no state.json)")
    state: dict[str, Any] = json.loads(state_file.read_text(encoding="utf-8"))
    if state["world_size"] != runtime.world_size:
        raise MemSearcherError(
            f"{folder} was written by {state['world_size']} ranks; resuming on "
            f"{runtime.world_size} would change the data order"
        )
    if is_sharded(model):
        optim = torch.load(folder / "optimizer.pt", map_location="cpu")
        load_full_state(model, optimizer, _read_weights(folder / "model"), optim)
    else:
        _load_weights(unwrap(model), folder / "model")
        device = runtime.device
        optimizer.load_state_dict(torch.load(folder / "optimizer.pt", map_location=device))
    scheduler.load_state_dict(torch.load(folder / "scheduler.pt"))
    rng = folder / f"rng-rank{runtime.rank}.pt"
    if rng.is_file():
        _set_rng_state(torch.load(rng, weights_only=False))
    return state


def resume_step(
    output_dir: Path, resume: bool, model: Any, optimizer: Any, scheduler: Any, runtime: Runtime
) -> int:
    """The last finished step: 0 for a fresh run, else the newest checkpoint's, loaded."""
    if not resume:
        return 0
    checkpoint = latest_checkpoint(output_dir)
    if checkpoint is None:
        raise MemSearcherError(f"--resume: no checkpoint in {output_dir}")
    return int(load_checkpoint(checkpoint, model, optimizer, scheduler, runtime)["step"])


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(shard))
    if not weights:
        raise MemSearcherError(f"{folder}: no safetensors weights")
    return weights


def _load_weights(model: Any, folder: Path) -> None:
    weights = _read_weights(folder)
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, weights)
        return
    missing, unexpected = model.load_state_dict(weights, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or set(missing) - tied:
        raise MemSearcherError(
            f"{folder}: weights do not fit the model (missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]})"
        )
    if missing:
        model.tie_weights()


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
