"""Seeds and data order: pure functions of the config's seed, so a resumed run sees what an
uninterrupted one would have seen."""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["draw", "seed_everything"]


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
