"""The learning tests over several seeds: does each meet its margin whatever the seed?

A learning test asserts that training improved something by a margin. On one machine and build
it is bit-identical run to run, so one passing run says little about another machine, whose
CPU kernels sum floats in another order and flip a sampled token a few steps in (issue 33). A
change of seed stands in for a change of machine: this runs each learning test once per seed
(``pytest --learning-seed N``) and prints, per test and seed, pass or fail and the measured
values the test records (``record_property``), so the margins in the tests' docstrings can be
checked.

    python benchmarks/learning_margins.py [TEST ...] [--seeds 0 1 2 3 4] [-k EXPR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

TESTS = (
    "tests/test_grpo_learns.py",
    "tests/test_ppo.py::test_ppo_with_a_critic_raises_reward_on_an_easy_task",
    "tests/test_ppo.py::test_value_head_starts_at_zero_and_learns",
    "tests/test_demo_copying.py",
)
"""Every test that asserts that training improved something."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("-k", default="", help="pytest -k expression to pick among the tests")
    parser.add_argument("tests", nargs="*", default=list(TESTS))
    args = parser.parse_args()
    root = Path(__file__).parents[1]
    results: dict[str, list[str]] = {}
    for seed in args.seeds:
        with tempfile.TemporaryDirectory() as scratch:
            report = Path(scratch) / "junit.xml"
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                       f"--learning-seed={seed}", f"--junitxml={report}", *args.tests]  # fmt: skip
            if args.k:
                command += ["-k", args.k]
            subprocess.run(command, cwd=root, check=False, capture_output=True)
            for case in ET.parse(report).getroot().iter("testcase"):
                name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
                failed = case.find("failure") is not None or case.find("error") is not None
                skipped = case.find("skipped") is not None
                verdict = "fail" if failed else "skip" if skipped else "pass"
                values = {p.get("name"): p.get("value") for p in case.iter("property")}
                line = f"seed {seed}: {verdict} {values or ''}"
                results.setdefault(name, []).append(line)
                print(f"{name} {line}", flush=True)
    print()
    for name, lines in results.items():
        passed = sum(" pass " in line for line in lines)
        print(f"{name}: {passed} of {len(lines)} seeds pass")
        for line in lines:
            print(f"  {line}")


if __name__ == "__main__":
    main()
