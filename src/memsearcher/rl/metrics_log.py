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
    """Rank 0 writes ``metrics.jsonl``, TensorBoard events and one compact line per step.

    A run resumed from step ``start`` first cuts the log back to that step: a run that died
    after logging steps it never saved would otherwise leave them twice (TensorBoard's events
    of those steps are purged the same way).
    """

    def __init__(
        self,
        output_dir: str | Path,
        runtime: Runtime,
        tensorboard: bool,
        echo: Callable[[str], None] | None = None,
        start: int = 0,
    ) -> None:
        self.enabled = runtime.is_main
        self.echo = echo or logger.info
        self.path = Path(output_dir) / "metrics.jsonl"
        self.writer: Any = None
        if self.enabled and start > 0 and self.path.is_file():
            self._cut_back(start)
        if self.enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                logger.warning("tensorboard is not installed; skipping events")
            else:
                purge = {"purge_step": start + 1} if start > 0 else {}
                self.writer = SummaryWriter(str(Path(output_dir) / "tensorboard"), **purge)

    def _cut_back(self, start: int) -> None:
        """Keep the lines of steps up to ``start``; a torn or foreign line ends the kept part."""
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                break
            if not isinstance(step, int) or step > start:
                break
            kept.append(line + "\n")
        staging = self.path.with_name(self.path.name + ".tmp")
        staging.write_text("".join(kept), encoding="utf-8")
        staging.replace(self.path)

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
