"""Metrics: rank 0 writes ``metrics.jsonl``, TensorBoard events and one compact line per step."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from memsearcher.rl.distributed import Runtime

logger = logging.getLogger(__name__)

__all__ = ["LINE_KEYS", "MetricsLog"]

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
