"""Ranks, devices and the collectives both trainers use.

Distributed runs use plain ``torch.distributed``: ``torchrun`` and ``accelerate launch`` both set
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``. Each rank then holds either a full replica wrapped in DDP
or a shard of every decoder layer (FSDP2, ``fully_shard``); `WRAPPERS` holds the two.

FSDP gathers a layer's weights in every forward and backward, so all ranks must run the same
number of passes. Rollouts and log-prob recomputation (uneven per rank) therefore run inside
`gathered`, and learner micro-batches are evened out across ranks with `even_out`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from memsearcher.errors import MemSearcherError

__all__ = [
    "WRAPPERS",
    "Runtime",
    "any_rank",
    "barrier",
    "even_out",
    "gathered",
    "init_runtime",
    "is_sharded",
    "no_sync",
    "reduce_mean",
    "sum_over_ranks",
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


def sum_over_ranks(value: float, runtime: Runtime) -> float:
    """``value`` summed over every rank (every rank must call this)."""
    if not runtime.distributed:
        return value
    total = torch.tensor([value], dtype=torch.float64, device=runtime.device)
    dist.all_reduce(total)
    return float(total.item())


def any_rank(flag: bool, runtime: Runtime) -> bool:
    """True on every rank when ``flag`` is true on any (every rank must call this)."""
    return sum_over_ranks(float(flag), runtime) > 0


def reduce_mean(metrics: Mapping[str, float], runtime: Runtime) -> dict[str, float]:
    """Each metric averaged over ranks (every rank must call this with the same keys)."""
    if not runtime.distributed or not metrics:
        return dict(metrics)
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    values = values.to(runtime.device)
    dist.all_reduce(values)
    return {k: v / runtime.world_size for k, v in zip(keys, values.tolist(), strict=True)}


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


def no_sync(model: Any, sync: bool) -> AbstractContextManager[Any]:
    """Skip DDP's gradient all-reduce on accumulation passes but the last. FSDP reduces every
    pass: its gradients stay sharded, which is the memory it is there to save."""
    if sync or not hasattr(model, "no_sync"):
        return nullcontext()
    context: AbstractContextManager[Any] = model.no_sync()
    return context
