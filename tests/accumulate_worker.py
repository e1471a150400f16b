"""Run by `test_train_distributed.py` under torchrun: one rank's share of a mini-batch through
`accumulate_gradients` under DDP, then rank 0 dumps the averaged gradient.

argv: the tiny model folder, the output file, the aggregation. Rank 0 holds sequence 0 only,
rank 1 the other five, so the ranks hold very different numbers of tokens and trajectories.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from test_batching import random_sequences
from transformers import AutoModelForCausalLM

from memsearcher.rl.batching import collate
from memsearcher.rl.config import GRPOConfig
from memsearcher.rl.distributed import init_runtime, wrap_for_training
from memsearcher.rl.learner import accumulate_gradients

SHARDS = [[0], [1, 2, 3, 4, 5]]
TRAJECTORY_IDS = torch.tensor([0, 1, 1, 2, 3, 3])
ADVANTAGES = torch.tensor([0.5, -1.0, -1.0, 1.5, 0.7, 0.7])


def inputs() -> tuple[list, list[torch.Tensor], list[torch.Tensor]]:
    """The six sequences with old and reference log-probs off the current ones."""
    sequences = random_sequences(6, seed=5)
    noise = torch.Generator().manual_seed(0)
    old = [-2.0 + 0.3 * torch.randn(len(s.response_ids), generator=noise) for s in sequences]
    ref = [value - 0.2 for value in old]
    return sequences, old, ref


def main() -> None:
    folder, out, aggregation = sys.argv[1:4]
    runtime = init_runtime("cpu")
    model = AutoModelForCausalLM.from_pretrained(folder)
    learner = wrap_for_training(model, runtime, "ddp")
    sequences, old, ref = inputs()
    config = GRPOConfig(aggregation=aggregation, beta=0.1, clip_low=0.2, clip_high=0.3)
    batch = collate(sequences, SHARDS[runtime.rank], pad_id=0)
    accumulate_gradients(learner, [batch], old, ref, ADVANTAGES, TRAJECTORY_IDS, config, runtime)
    if runtime.is_main:
        grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
        save_file(grads, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
