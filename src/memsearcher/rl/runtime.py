"""What both trainers share: ranks and devices, the model and optimizer, data order, metrics.

Distributed runs use plain ``torch.distributed``: ``torchrun`` and ``accelerate launch`` both set
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``. Each rank then holds either a full replica wrapped in DDP
or a shard of every decoder layer (FSDP2, ``fully_shard``); `WRAPPERS` holds the two.

FSDP gathers a layer's weights in every forward and backward, so all ranks must run the same
number of passes. Rollouts and log-prob recomputation (uneven per rank) therefore run inside
`gathered`, and learner micro-batches are evened out across ranks with `even_out`.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math
import os
import random
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from memsearcher.errors import MemSearcherError
from memsearcher.rl.config import ModelConfig, OptimConfig

logger = logging.getLogger(__name__)

__all__ = [
    "SCHEDULES",
    "WRAPPERS",
    "MetricsLog",
    "Runtime",
    "barrier",
    "draw",
    "even_out",
    "frozen_copy",
    "full_state",
    "gathered",
    "init_runtime",
    "is_sharded",
    "load_full_state",
    "load_policy",
    "make_optimizer",
    "make_scheduler",
    "no_sync",
    "reduce_mean",
    "rollout_precision",
    "seed_everything",
    "unwrap",
    "wrap_for_training",
]


@dataclass(frozen=True)
class Runtime:
    """This process's place in the run."""

    rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_runtime(device: str = "auto") -> Runtime:
    """Join the process group when launched with several ranks; pick this rank's device."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = torch.cuda.is_available() and device != "cpu"
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    if use_cuda:
        target = torch.device("cuda", local_rank)
        torch.cuda.set_device(target)
    else:
        target = torch.device("cpu")
    return Runtime(rank=rank, world_size=world_size, device=target)


def barrier(runtime: Runtime) -> None:
    if runtime.distributed:
        dist.barrier()


def reduce_mean(metrics: Mapping[str, float], runtime: Runtime) -> dict[str, float]:
    """Each metric averaged over ranks (every rank must call this with the same keys)."""
    if not runtime.distributed or not metrics:
        return dict(metrics)
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    values = values.to(runtime.device)
    dist.all_reduce(values)
    return {k: v / runtime.world_size for k, v in zip(keys, values.tolist(), strict=True)}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def draw(num_items: int, start: int, count: int, seed: int) -> list[int]:
    """Items ``start .. start + count`` of an endless run of seeded epoch permutations.

    A pure function of its arguments, so the data order after a resume is the order an
    uninterrupted run would have seen.
    """
    out: list[int] = []
    for position in range(start, start + count):
        epoch, offset = divmod(position, num_items)
        if offset == 0 or not out:
            order = list(range(num_items))
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        out.append(order[offset])
    return out


def load_policy(config: ModelConfig, runtime: Runtime) -> tuple[Any, Any]:
    """The trainable model (LoRA-wrapped if asked) on this rank's device, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = config.path
    if path == "embedded":
        from memsearcher.llm.embedded import embedded_model_path

        path = str(embedded_model_path())
    if config.dtype == "auto":
        dtype = torch.bfloat16 if runtime.device.type == "cuda" else torch.float32
    else:
        dtype = getattr(torch, config.dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as error:
        raise MemSearcherError(f"cannot load model {path!r}: {error}") from error
    _disable_dropout(model)
    if config.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.config.use_cache = False
    if config.lora_rank > 0:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError:
            raise MemSearcherError("LoRA needs peft: pip install 'memsearcher[train]'") from None
        lora = LoraConfig(
            r=config.lora_rank,
            lora_alpha=config.lora_alpha,
            target_modules=list(config.lora_targets),
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        )
        model = get_peft_model(model, lora)
    model.to(runtime.device)
    return model, tokenizer


def _disable_dropout(model: torch.nn.Module) -> None:
    """Dropout off everywhere: with it, log-probs of the same weights differ between the
    old-policy pass and the update, and the ratio is no longer 1 on-policy (TRL's
    ``disable_dropout`` does the same)."""
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            setattr(module, "attention_dropout", 0.0)  # noqa: B010


def frozen_copy(model: Any) -> Any:
    """A frozen copy of the initial model, the KL reference of full fine-tuning."""
    reference = copy.deepcopy(model).eval()
    for parameter in reference.parameters():
        parameter.requires_grad_(False)
    return reference


def _ddp(model: Any, runtime: Runtime) -> Any:
    """A full replica per rank; DDP broadcasts rank 0's weights, so replicas start equal."""
    from torch.nn.parallel import DistributedDataParallel

    ids = [runtime.device.index] if runtime.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def _fsdp(model: Any, runtime: Runtime) -> Any:
    """Every decoder layer sharded over the ranks, then the rest (embeddings, head) as the root.

    ``fully_shard`` works in place and keeps parameter names, so the optimizer, LoRA's
    ``requires_grad`` flags and ``model.save_pretrained`` still see the original module. It
    cuts each rank's shard from that rank's own weights, so rank 0's are broadcast first, as
    DDP does.
    """
    from torch.distributed.fsdp import fully_shard

    layers = _decoder_layers(model)
    if not layers:
        raise MemSearcherError(f"fsdp: found no decoder layers in {type(model).__name__}")
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    # FSDP2 takes the first module it sees run forward as the root. peft's generate goes
    # around the root to the inner model, which would make a layer its own root; one
    # pass through the real root settles it. The root keeps its weights gathered after a
    # forward (for the backward), so shard them again before the optimizer sees them.
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=runtime.device))
    model.reshard()
    return model


def _decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The repeated blocks: the modules named in HF's ``_no_split_modules``."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


WRAPPERS: dict[str, Callable[[Any, Runtime], Any]] = {"ddp": _ddp, "fsdp": _fsdp}


def wrap_for_training(model: Any, runtime: Runtime, strategy: str = "ddp") -> Any:
    """The model as the ranks train it together (`WRAPPERS`); itself in a single process."""
    if strategy not in WRAPPERS:
        raise MemSearcherError(
            f"unknown model.distributed {strategy!r}; choose one of {sorted(WRAPPERS)}"
        )
    # accelerate's FSDP config only sets environment variables; a run that ignored them
    # would quietly hold a full replica per GPU.
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true" and strategy != "fsdp":
        raise MemSearcherError(
            "launched with an accelerate FSDP config: set model.distributed=fsdp"
        )
    if not runtime.distributed:
        return model
    return WRAPPERS[strategy](model, runtime)


def is_sharded(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def unwrap(model: Any) -> Any:
    return model.module if hasattr(model, "require_backward_grad_sync") else model


@contextmanager
def gathered(model: Any) -> Iterator[None]:
    """Full weights on every rank for a while, so ranks may run different numbers of forward
    passes (rollouts, log-prob recomputation) without FSDP's per-pass all-gathers; a no-op
    for unsharded models. Memory is a full replica's, as under DDP."""
    if not is_sharded(model):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for module in sharded:
        module.unshard()
        module.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for module in sharded:
            module.reshard()
            if module is not model:  # the root never reshards after forward (FSDP2's default)
                module.set_reshard_after_forward(True, recurse=False)


def even_out(batches: list[Any], learner: Any, runtime: Runtime) -> list[Any]:
    """Pad this rank's micro-batches to the largest count over ranks with copies whose loss
    mask is zero (no loss, no gradient), so every rank runs as many FSDP passes."""
    if not runtime.distributed or not is_sharded(learner):
        return batches
    count = torch.tensor([len(batches)], device=runtime.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    blank = dataclasses.replace(batches[0], loss_mask=torch.zeros_like(batches[0].loss_mask))
    return batches + [blank] * (int(count.item()) - len(batches))


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


def no_sync(model: Any, sync: bool) -> AbstractContextManager[Any]:
    """Skip DDP's gradient all-reduce on accumulation passes but the last. FSDP reduces every
    pass: its gradients stay sharded, which is the memory it is there to save."""
    if sync or not hasattr(model, "no_sync"):
        return nullcontext()
    context: AbstractContextManager[Any] = model.no_sync()
    return context


def rollout_precision(autocast: str | None, runtime: Runtime) -> AbstractContextManager[Any]:
    """Generation in the ``autocast`` dtype, as the learner's forward passes."""
    if autocast is None:
        return nullcontext()
    return torch.autocast(runtime.device.type, dtype=getattr(torch, autocast))


def make_optimizer(model: Any, config: OptimConfig) -> torch.optim.Optimizer:
    parameters = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(
        parameters, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay
    )


def _constant(progress: float) -> float:
    return 1.0


def _cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


SCHEDULES: dict[str, Callable[[float], float]] = {"constant": _constant, "cosine": _cosine}


def make_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimConfig, total_updates: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup_steps`` updates, then a `SCHEDULES` shape."""
    if config.schedule not in SCHEDULES:
        raise MemSearcherError(
            f"unknown schedule {config.schedule!r}; choose one of {sorted(SCHEDULES)}"
        )
    shape = SCHEDULES[config.schedule]
    warmup = config.warmup_steps

    def factor(update: int) -> float:
        if update < warmup:
            return (update + 1) / warmup
        return shape((update - warmup) / max(1, total_updates - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


LINE_KEYS = (
    "reward/mean",
    "reward/std",
    "reward/em",
    "rollout/format_failure",
    "rollout/turns",
    "rollout/prompt_tokens",
    "train/loss",
    "train/kl",
    "train/clip_fraction",
    "train/grad_norm",
    "time/step",
)


class MetricsLog:
    """Rank 0 writes ``metrics.jsonl``, TensorBoard events and one compact line per step."""

    def __init__(
        self,
        output_dir: str | Path,
        runtime: Runtime,
        tensorboard: bool,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        self.enabled = runtime.is_main
        self.echo = echo or logger.info
        self.path = Path(output_dir) / "metrics.jsonl"
        self.writer: Any = None
        if self.enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                logger.warning("tensorboard is not installed; skipping events")
            else:
                self.writer = SummaryWriter(str(Path(output_dir) / "tensorboard"))

    def config(self, config: Mapping[str, Any]) -> None:
        if self.enabled:
            self.echo("config " + json.dumps(config, sort_keys=True))
            if self.writer is not None:
                self.writer.add_text("config", json.dumps(config, indent=2))

    def log(self, step: int, total: int, metrics: Mapping[str, float]) -> None:
        if not self.enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as out:
            out.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.writer is not None:
            for key, value in metrics.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        shown = " ".join(f"{k}={metrics[k]:.4g}" for k in LINE_KEYS if k in metrics)
        self.echo(f"step {step}/{total} {shown}")

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
