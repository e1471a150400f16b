"""Learning-rate schedule shapes: the factor of the peak lr at a share of training done."""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["SCHEDULES"]


def _constant(progress: float) -> float:
    return 1.0


def _cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


SCHEDULES: dict[str, Callable[[float], float]] = {"constant": _constant, "cosine": _cosine}
"""After warm-up: constant, or cosine towards 0 at the end (as HF's cosine schedule). The name
is checked once, by `OptimConfig`."""
