"""Checkpoints: weights in safetensors (HF ``save_pretrained``), plus optimizer, scheduler,
RNG and data-order state, written atomically.

A checkpoint is ``OUTPUT/step-N/``: it is written under a temporary name and renamed once
complete, so a crash never leaves a half-written ``step-N``. Every rank saves its own RNG state;
rank 0 writes everything else. An FSDP model's shards are gathered first, so its checkpoint is
the same whole-model folder as a single process writes.

A fresh run refuses a folder that holds checkpoints, and a resumed run refuses a config that
would change the run: ``OUTPUT/config.json`` keeps the run's config, and only the keys of
:data:`FREE_ON_RESUME` may differ from it (:func:`check_run_folder`).

Nothing is unpickled on resume, so a checkpoint from someone else is safe to load: weights are
safetensors, the scheduler, RNG and run state are JSON, and the optimizer state (tensors in
nested dicts) is read with ``torch.load(weights_only=True)``, which refuses any other type.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memsearcher.config import changed_keys
from memsearcher.errors import MemSearcherError
from memsearcher.rl.distributed import Runtime, barrier, is_sharded, unwrap

__all__ = [
    "FREE_ON_RESUME",
    "check_run_folder",
    "full_state",
    "latest_checkpoint",
    "load_checkpoint",
    "load_full_state",
    "resume_step",
    "save_checkpoint",
]

logger = logging.getLogger(__name__)

_STEP = re.compile(r"^step-(\d+)$")
RUN_CONFIG = "config.json"
FREE_ON_RESUME = frozenset(
    {"output_dir", "steps", "log_every", "save_every", "sample_every", "tensorboard",
     "retriever_cache"}
)  # fmt: skip
"""What a resumed run may change: how long it runs, when and where it logs and saves, and how
many search answers it keeps (the answers are the same either way)."""


def check_run_folder(
    output_dir: Path,
    config: dict[str, Any],
    resume: bool | int,
    runtime: Runtime,
    defaults: dict[str, Any] | None = None,
) -> None:
    """Refuse a fresh run where checkpoints exist, and a resumed one whose ``config`` (as
    `config_to_dict` writes it) changes the run; then keep ``config`` as the run's. A key the
    saved config lacks counts as its value in ``defaults`` (the config class's defaults, as
    `config_to_dict` writes them): the run was saved before the key existed."""
    saved = output_dir / RUN_CONFIG
    if not resume:
        found = sorted(p.name for p in output_dir.glob("step-*") if _STEP.match(p.name))
        if found:
            raise MemSearcherError(
                f"{output_dir} already holds checkpoints of a run ({', '.join(found[:3])}"
                f"{', ...' if len(found) > 3 else ''}); pass --resume to continue it, or choose "
                "another output_dir"
            )
    elif latest_checkpoint(output_dir) is None:
        return  # resume_step says there is nothing to resume
    elif saved.is_file():
        changed = [k for k in changed_keys(_read_json(saved), config, defaults)
                   if k not in FREE_ON_RESUME]  # fmt: skip
        if changed:
            raise MemSearcherError(
                f"{output_dir} holds a run with other settings ({', '.join(changed)}); resume "
                f"with its settings (only {', '.join(sorted(FREE_ON_RESUME))} may change), or "
                "start a fresh run in another output_dir"
            )
    else:
        logger.warning("%s has no %s (an older run): resuming unchecked", output_dir, RUN_CONFIG)
    if runtime.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        staging = saved.with_name(f".{RUN_CONFIG}.tmp")  # other ranks may be reading it
        _write_json(staging, config)
        os.replace(staging, saved)


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
    _write_json(staging / f"rng-rank{runtime.rank}.json", _rng_state())
    weights, optim = full_state(model, optimizer) if is_sharded(model) else (None, None)
    if runtime.is_main:
        model = unwrap(model)
        model.save_pretrained(staging / "model", state_dict=weights, safe_serialization=True)
        tokenizer.save_pretrained(staging / "model")
        torch.save(optim or optimizer.state_dict(), staging / "optimizer.pt")
        _write_json(staging / "scheduler.json", scheduler.state_dict())
    barrier(runtime)
    if runtime.is_main:
        # state.json last: latest_checkpoint treats a folder without it as incomplete.
        state = {**state, "step": step, "world_size": runtime.world_size}
        _write_json(staging / "state.json", state)
        # Synced before the rename publishes them: after a power cut the rename could reach
        # the disk before the data, leaving a complete-looking step-N of empty files.
        _sync_tree(staging)
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        _sync(final.parent)
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
    if not (folder / "state.json").is_file():
        raise MemSearcherError(f"{folder} is not a complete checkpoint (no state.json)")
    state = _read_json(folder / "state.json")
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise MemSearcherError(
            f"{folder / 'state.json'}: not a checkpoint state (an object with an integer "
            f"'step'), got {json.dumps(state)[:80]}"
        )
    if state.get("world_size") != runtime.world_size:
        raise MemSearcherError(
            f"{folder} was written by {state.get('world_size')} ranks; resuming on "
            f"{runtime.world_size} would change the data order"
        )
    optim = _load_tensors(folder / "optimizer.pt", runtime.device)
    if is_sharded(model):
        load_full_state(model, optimizer, _read_weights(folder / "model"), optim)
    else:
        _load_weights(unwrap(model), folder / "model")
        try:
            optimizer.load_state_dict(optim)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise MemSearcherError(
                f"{folder / 'optimizer.pt'}: does not fit this run's optimizer ({error!r:.200})"
            ) from None
    _load_scheduler(scheduler, folder / "scheduler.json")
    rng = folder / f"rng-rank{runtime.rank}.json"
    if not rng.is_file():
        raise MemSearcherError(f"{folder}: no {rng.name} (written by an older memsearcher?)")
    _set_rng_state(_read_json(rng))
    return state


def resume_step(
    output_dir: Path,
    resume: bool | int,
    model: Any,
    optimizer: Any,
    scheduler: Any,
    runtime: Runtime,
) -> int:
    """The last finished step: 0 for a fresh run, else the newest checkpoint's, loaded;
    ``resume`` an int (not True) loads the checkpoint of that step instead (``--resume-from``)."""
    if resume is False:
        return 0
    if resume is True:
        checkpoint = latest_checkpoint(output_dir)
        if checkpoint is None:
            raise MemSearcherError(f"--resume: no checkpoint in {output_dir}")
    else:
        checkpoint = Path(output_dir) / f"step-{resume}"
        if not (checkpoint / "state.json").is_file():
            raise MemSearcherError(f"--resume-from: no complete checkpoint {checkpoint}")
    return int(load_checkpoint(checkpoint, model, optimizer, scheduler, runtime)["step"])


def full_state(model: Any, optimizer: torch.optim.Optimizer) -> tuple[Any, Any]:
    """A sharded model's and its optimizer's state dicts, gathered whole onto rank 0's CPU
    (every rank must call this); keyed by parameter name, as `load_full_state` reads them."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    optim = get_optimizer_state_dict(model, optimizer, options=options)
    return weights, optim


def load_full_state(
    model: Any, optimizer: torch.optim.Optimizer, weights: dict[str, Any], optim: Any
) -> None:
    """Load `full_state`'s whole state dicts into a sharded model: each rank keeps its shard.

    ``weights`` is keyed as ``model.state_dict()``, or as a peft adapter file (no adapter name),
    and may lack tied or frozen weights.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    own = list(model.state_dict())
    if hasattr(model, "peft_config"):
        # peft saves lora_A.weight for the parameter lora_A.default.weight
        by_saved = {key.replace(".default.", "."): key for key in own}
        weights = {by_saved.get(k, k): v for k, v in weights.items()}
    unknown = sorted(set(weights) - set(own))
    if unknown:
        raise MemSearcherError(f"weights do not fit the model (unexpected {unknown[:5]})")
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, weights, options=options)
    set_optimizer_state_dict(model, optimizer, optim, options=options)


# What a LambdaLR's state holds in every torch version (the private keys come and go).
_SCHEDULE_KEYS = frozenset({"base_lrs", "last_epoch", "lr_lambdas"})


def _load_scheduler(scheduler: Any, path: Path) -> None:
    saved = _read_json(path)
    groups = len(scheduler.base_lrs)
    if (
        not isinstance(saved, dict)
        or not set(saved) >= _SCHEDULE_KEYS
        or not isinstance(saved["base_lrs"], list)
        or len(saved["base_lrs"]) != groups
    ):
        raise MemSearcherError(
            f"{path}: not the state of this run's schedule (a LambdaLR over {groups} parameter "
            f"group(s), with {sorted(_SCHEDULE_KEYS)}), found {json.dumps(saved)[:80]}"
        )
    scheduler.load_state_dict(saved)


def _sync(path: Path) -> None:
    """fsync a file or a folder (a folder's entries: the names of the files in it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_tree(folder: Path) -> None:
    for path in sorted(folder.rglob("*"), reverse=True):  # files before their folders
        _sync(path)
    _sync(folder)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1), encoding="utf-8")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise MemSearcherError(f"{path}: cannot read checkpoint state ({error})") from None


def _load_tensors(path: Path, device: torch.device) -> Any:
    """Tensors in nested dicts and lists, and nothing else: ``weights_only`` refuses every
    other pickled type, so a crafted file cannot run code."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError:
        raise MemSearcherError(
            f"{path}: not loaded: it holds pickled objects other than tensors, and unpickling "
            "them could run code"
        ) from None
    except (OSError, RuntimeError, EOFError) as error:
        raise MemSearcherError(f"{path}: not loaded ({error!r})") from None


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        try:
            weights.update(load_file(shard))
        except (OSError, SafetensorError) as error:
            raise MemSearcherError(f"{shard}: not loaded, damaged or cut short ({error})") from None
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


def _bytes(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")


def _tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _rng_state() -> dict[str, Any]:
    """Python's, NumPy's, torch's and CUDA's generators as plain JSON data."""
    version, internal, gauss = random.getstate()
    kind, keys, position, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": [kind, np.asarray(keys).tolist(), int(position), int(has_gauss), float(cached)],
        "torch": _bytes(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_bytes(s) for s in torch.cuda.get_rng_state_all()]
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    try:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        kind, keys, position, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, cached))
        torch.set_rng_state(_tensor(state["torch"]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([_tensor(s) for s in state["cuda"]])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise MemSearcherError(f"the checkpoint's RNG state is malformed ({error})") from None
