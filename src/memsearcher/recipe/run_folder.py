"""The recipe's folder: which folder a run may write into, and what a longer GRPO run sets
aside.

``OUT/recipe.json`` records the config that made the folder. A rerun must match it, but for
``OUTPUT_ONLY`` keys and one change a researcher whose reward still rises asks for: a larger
``grpo.steps`` under a constant learning rate. GRPO then trains on from its checkpoints, and
what the shorter run made moves to ``OUT/superseded/grpo-<N>-steps/``, never deleted. To go
back, move those folders back and write the old ``grpo.steps`` into ``recipe.json``.

``OUT/timings.json`` holds each stage's seconds, summed over the runs that worked on it
(`StageClock`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from memsearcher.config import changed_keys
from memsearcher.errors import MemSearcherError
from memsearcher.teach.oracle import AGENTS

__all__ = ["MARKER", "OUTPUT_ONLY", "StageClock", "claim", "set_aside_grpo"]

MARKER = "recipe.json"
OUTPUT_ONLY = ("ship", "bootstrap")
"""Config keys that change only what is written after training, so a finished run may be
rerun with other values of them."""
TIMINGS = "timings.json"
RUNNING = "stage.running.json"
"""Which stage a run is in, and since when (wall-clock seconds); gone when the stage ends."""
REPORT = ("results.json", "report.md", "reward_per_step.png")
"""The report's files, which describe the whole run and so move aside with GRPO's products."""


def claim(out: Path, config: dict[str, Any], defaults: dict[str, Any] | None = None) -> None:
    """Make ``out`` the recipe's folder for ``config`` (a `RecipeConfig` as plain data): a new
    or empty folder, or one whose marker holds this very config (a resumed run), or that
    config with more GRPO steps under a constant learning rate (GRPO trains on from its last
    checkpoint; what its shorter run made is set aside). Anything else is refused and left as
    it is. A key the marker lacks counts as its value in ``defaults`` (`default_dict`)."""
    settings = {k: v for k, v in config.items() if k not in OUTPUT_ONLY}
    grpo = settings["grpo"]
    marker = out / MARKER
    if marker.is_file():
        saved = _read_marker(marker)
        changed = changed_keys(saved, settings, defaults)
        longer = changed == ["grpo.steps"] and grpo["steps"] > saved["grpo"]["steps"]
        if longer and grpo["optim"]["schedule"] != "constant":
            raise MemSearcherError(
                f"{out}: more GRPO steps would restart grpo.optim.schedule "
                f"({grpo['optim']['schedule']}) part-way, which no fresh run does; only a "
                "constant schedule may train on"
            )
        if changed and not longer:
            raise MemSearcherError(
                f"{out} holds a recipe run with another config (changed: {', '.join(changed)}); "
                "only more GRPO steps (a larger grpo.steps) may be asked of it: choose another "
                "out, or run it with the config it was made with"
            )
        if longer:
            set_aside_grpo(out, saved["grpo"]["steps"])
            _write_marker(marker, settings)
        return
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise MemSearcherError(f"out {out} is not a folder; choose a folder")
    if out.is_dir() and any(out.iterdir()):
        raise MemSearcherError(
            f"out {out} is not empty and no recipe run made it (no {MARKER}); nothing was "
            "touched: choose a new or empty folder"
        )
    out.mkdir(parents=True, exist_ok=True)
    _write_marker(marker, settings)


def set_aside_grpo(out: Path, steps: int) -> None:
    """Move what GRPO's run of ``steps`` steps made (each agent's merged model, exported
    adapter and evaluation) and the report to ``superseded/grpo-<steps>-steps/``, with a copy
    of ``timings.json``: a rerun would find them done and report them as the longer run's.
    Moved, never deleted; the checkpoints stay, for GRPO to train on from. Everything is
    checked before anything moves."""
    aside = out / "superseded" / f"grpo-{steps}-steps"
    made = [Path(kind) / f"grpo-{agent}" for kind in ("models", "adapters", "eval")
            for agent in AGENTS] + [Path(name) for name in REPORT]  # fmt: skip
    moving = [name for name in made if os.path.lexists(out / name)]
    for name in moving:
        if os.path.lexists(aside / name):
            raise MemSearcherError(
                f"{aside / name} exists already, so {out / name} cannot move there; nothing "
                "was moved. Both come from the same shorter run: move one of them away"
            )
    try:
        for name in moving:
            (aside / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).rename(aside / name)
        if (out / TIMINGS).is_file():
            shutil.copyfile(out / TIMINGS, aside / TIMINGS)
    except OSError as error:
        raise MemSearcherError(
            f"setting the {steps}-step run's results aside in {aside} failed ({error}); "
            "what moved is there, the rest where it was"
        ) from error


def _read_marker(marker: Path) -> dict[str, Any]:
    try:
        saved = json.loads(marker.read_text("utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise MemSearcherError(f"{marker} is not a recipe's config ({error})") from error
    if not isinstance(saved, dict):
        raise MemSearcherError(f"{marker} is not a recipe's config (not a mapping)")
    return {k: v for k, v in saved.items() if k not in OUTPUT_ONLY}


def _write_marker(marker: Path, settings: dict[str, Any]) -> None:
    """Write ``settings`` whole or not at all (a marker cut short would lock the folder)."""
    staging = marker.with_name(marker.name + ".tmp")
    staging.write_text(json.dumps(settings, indent=2) + "\n", "utf-8")
    staging.replace(marker)


class StageClock:
    """Each stage's seconds in ``OUT/timings.json``, summed over the runs that worked on it, since
    the stages resume from their checkpoints and a build may span several runs.

    A run stopped by an exception (Ctrl-C) adds its time as it leaves the stage. A killed one
    (SIGKILL, a machine or session that ends) leaves ``OUT/stage.running.json`` behind, and the
    next run credits that stage with the time from its start to the last file the killed run
    wrote in ``OUT`` (its last checkpoint or log line): work after that was lost, and is
    counted when it is done again. A stage found done (under 5 s) adds nothing."""

    def __init__(self, out: Path) -> None:
        self.file = out / TIMINGS
        self.running = out / RUNNING
        self.seconds: dict[str, float] = (
            json.loads(self.file.read_text("utf-8")) if self.file.is_file() else {}
        )
        if self.running.is_file():
            self._credit_killed_run(out)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        _write_marker(self.running, {"stage": name, "started": time.time()})
        begun = time.perf_counter()
        try:
            yield
        finally:
            self._add(name, time.perf_counter() - begun)
            self.running.unlink(missing_ok=True)

    def _credit_killed_run(self, out: Path) -> None:
        try:
            running = json.loads(self.running.read_text("utf-8"))
            stage, started = str(running["stage"]), float(running["started"])
        except (ValueError, UnicodeDecodeError, KeyError, TypeError) as error:
            raise MemSearcherError(
                f"{self.running} is not a stage's start ({error}); the recipe wrote it whole, "
                "so something else changed it: delete it to go on (only that stage's time of "
                "the interrupted run is lost)"
            ) from error
        mine = {self.file, self.running}
        written = [p.stat().st_mtime for p in out.rglob("*") if p.is_file() and p not in mine]
        self._add(stage, max(written, default=0.0) - started)
        self.running.unlink()

    def _add(self, name: str, seconds: float) -> None:
        if seconds >= 5:
            self.seconds[name] = round(self.seconds.get(name, 0.0) + seconds, 1)
        self.file.write_text(json.dumps(self.seconds, indent=2) + "\n", "utf-8")
