"""Run by `test_train_distributed.py` under torchrun: one GRPO rank, then dump its weights.

argv: output folder, then ``--resume`` optionally, then config overrides. Under FSDP each rank
holds shards; ``full_tensor()`` gathers them, so both ranks dump whole weights.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from memsearcher.rl.config import GRPOConfig, load_config
from memsearcher.rl.distributed import unwrap
from memsearcher.rl.rewards import REWARDS
from memsearcher.rl.train_grpo import train_grpo
from memsearcher.types import Trajectory


def length_reward(trajectory: Trajectory) -> float:
    return float(len(trajectory.turns[0].action_text) % 5) / 5 if trajectory.turns else 0.0


def main() -> None:
    out = Path(sys.argv[1])
    args = sys.argv[2:]
    resume = bool(args) and args[0] == "--resume"
    REWARDS["test-length"] = length_reward
    config = load_config(GRPOConfig, None, args[1:] if resume else args)
    model = train_grpo(config, resume=resume)
    rank = dist.get_rank()
    state = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in unwrap(model).state_dict().items()
    }
    save_file(state, str(out / f"rank{rank}.safetensors"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
