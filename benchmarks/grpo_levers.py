"""The demo's GRPO with and without its learner settings, side by side (issue 31).

    python benchmarks/grpo_levers.py RUN [--agent memsearcher] [--steps 2] [--repeats 3]

``RUN`` is a finished `memsearcher demo` folder: its SFT model, GRPO's renamed world and the
templates are the start. Each repeat runs ``--steps`` GRPO steps of the demo's config twice,
once with ``share_prefix`` and ``reuse_logprobs`` (the demo's settings: each batch's shared
system prompt computed once, and with one update a step the update's own log-probs standing
for the old ones) and once without, in turn, each into a fresh folder; it prints each pair's
seconds and the median ratio (without / with: above 1 is faster). Both settings give the same
update to float rounding (tests/test_train.py); only time differs.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from memsearcher.demo.pipeline import PRESETS, grpo_config
from memsearcher.rl.train_grpo import train_grpo


def timed_run(run: Path, agent: str, steps: int, levers: bool) -> float:
    config = replace(PRESETS["full"], grpo_steps=steps)
    sft = next((run / "sft").glob("step-*")) / "model"
    with tempfile.TemporaryDirectory() as tmp:
        grpo = grpo_config(config, agent, run / "grpo-world", run / "templates.yaml", sft,
                           Path(tmp) / "grpo", seed=0)  # fmt: skip
        grpo = replace(grpo, share_prefix=levers, reuse_logprobs=levers)
        started = time.perf_counter()
        train_grpo(grpo)
        return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a finished demo folder")
    parser.add_argument("--agent", default="memsearcher")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ratios = []
    for repeat in range(args.repeats):
        plain = timed_run(args.run, args.agent, args.steps, levers=False)
        levers = timed_run(args.run, args.agent, args.steps, levers=True)
        ratios.append(plain / levers)
        print(f"repeat {repeat + 1}: without {plain:.1f} s, with {levers:.1f} s, "
              f"{ratios[-1]:.2f}x", flush=True)  # fmt: skip
    print(f"median speed-up of share_prefix + reuse_logprobs: {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
