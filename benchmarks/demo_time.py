"""How long `memsearcher demo` takes, stage by stage, and whether its learning criteria hold
(issue 31).

    python benchmarks/demo_time.py RUN [RUN ...]               # finished demo folders
    python benchmarks/demo_time.py --run --seed 0 --out DIR     # run the demo first, then read it

Reads each run's ``results.json`` (the demo writes each stage's seconds under ``timings``) and
prints one column of seconds a run, a stage a row, with the total; beside the first run, each
later run's speed-up on every stage (first / later: above 1 is faster). Then, for each run, the
criteria the demo must keep whatever makes it faster:

- GRPO minus SFT on MemSearcher's held-out EM at least ``MIN_GAIN``;
- MemSearcher's EM at least ReAct's after GRPO;
- MemSearcher's prompt flat (its last turn's mean prompt at most ``FLAT`` times its first's)
  while ReAct's grows (at least ``GROWS`` times);
- the whole run within ``TARGET_SECONDS``: with ``--run``, the command's own wall time, from
  Python's start to the written report; else the run's recorded total.

With runs of two or more seeds, the gain must also stand above the spread of the gains across
the seeds (max - min), as docs/demo.md asks. Times are what the run measured on its machine:
compare runs made alone on the same machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MIN_GAIN = 0.05
FLAT = 1.5
GROWS = 2.0
TARGET_SECONDS = 15 * 60


def load(run: Path) -> dict[str, Any]:
    path = run / "results.json"
    if not path.is_file():
        raise SystemExit(f"{path} does not exist: is {run} a finished demo run?")
    results: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return results


def gain(results: dict[str, Any]) -> float:
    """GRPO minus SFT on MemSearcher's held-out EM."""
    evaluations = results["evaluations"]
    return float(evaluations["sft+grpo/memsearcher"]["em"] - evaluations["sft/memsearcher"]["em"])


def growth(results: dict[str, Any], agent: str) -> float:
    """The last turn's mean prompt over the first's, after GRPO."""
    by_turn = results["evaluations"][f"sft+grpo/{agent}"].get("prompt_tokens_by_turn") or [1.0]
    return float(by_turn[-1] / by_turn[0])


def criteria(results: dict[str, Any], wall: float | None = None) -> list[tuple[str, bool]]:
    """The demo's criteria on one run; ``wall``, the command's seconds from start to report
    where this script ran it, stands for the run's own total (which leaves out Python's start
    and the report)."""
    evaluations = results["evaluations"]
    memsearcher, react = (evaluations[f"sft+grpo/{a}"]["em"] for a in ("memsearcher", "react"))
    flat, grows = growth(results, "memsearcher"), growth(results, "react")
    total, what = (results["timings"]["total"], "total") if wall is None else (wall, "command")
    return [
        (f"GRPO - SFT on MemSearcher's EM {gain(results):+.3f} >= {MIN_GAIN}",
         gain(results) >= MIN_GAIN),
        (f"MemSearcher {memsearcher:.3f} >= ReAct {react:.3f} after GRPO", memsearcher >= react),
        (f"MemSearcher's prompt x{flat:.2f} over its turns (<= {FLAT})", flat <= FLAT),
        (f"ReAct's prompt x{grows:.2f} over its turns (>= {GROWS})", grows >= GROWS),
        (f"{what} {total:.0f} s <= {TARGET_SECONDS} s", total <= TARGET_SECONDS),
    ]  # fmt: skip


def stage_table(names: list[str], runs: list[dict[str, Any]]) -> str:
    stages = list(dict.fromkeys(s for r in runs for s in r["timings"] if s != "total"))
    stages.append("total")
    head = ["stage", *names, *(f"x {name}" for name in names[1:])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for stage in stages:
        seconds = [r["timings"].get(stage) for r in runs]
        cells = [stage, *("-" if s is None else f"{s:,.0f}" for s in seconds)]
        first = seconds[0]
        for later in seconds[1:]:
            cells.append(f"{first / later:.2f}" if first and later else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(paths: list[Path], walls: dict[Path, float]) -> bool:
    runs = [load(path) for path in paths]
    names = [f"{path.name} (seed {r['seed']})" for path, r in zip(paths, runs, strict=True)]
    print(stage_table(names, runs))
    ok = True
    for name, path, results in zip(names, paths, runs, strict=True):
        print(f"\n{name}:")
        for text, holds in criteria(results, walls.get(path)):
            print(f"  [{'x' if holds else ' '}] {text}")
            ok &= holds
    seeds = {r["seed"]: gain(r) for r in runs}
    if len(seeds) > 1:
        spread = max(seeds.values()) - min(seeds.values())
        above = min(seeds.values()) > spread
        print(f"\ngains by seed {seeds}: spread {spread:.3f}; every gain above it: {above}")
        ok &= above
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="*", type=Path, help="finished demo folders")
    parser.add_argument("--run", action="store_true", help="run `memsearcher demo` first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="the demo's folder, with --run")
    args = parser.parse_args(argv)
    runs = list(args.runs)
    walls: dict[Path, float] = {}
    if args.run:
        if args.out is None:
            parser.error("--run needs --out")
        command = [sys.executable, "-m", "memsearcher.cli", "demo", "--seed", str(args.seed)]
        begun = time.perf_counter()
        subprocess.run([*command, "--out", str(args.out)], check=True)
        walls[args.out] = time.perf_counter() - begun
        print(
            f"`memsearcher demo --seed {args.seed}`: {walls[args.out]:.0f} s from start to "
            "report (the run's own total leaves out Python's start and the report)"
        )
        runs.append(args.out)
    if not runs:
        parser.error("give finished demo folders, or --run --out DIR")
    return 0 if report(runs, walls) else 1


if __name__ == "__main__":
    sys.exit(main())
