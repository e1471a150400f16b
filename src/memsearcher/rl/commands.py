"""``memsearcher train grpo|ppo|sft --config FILE [--resume | --resume-from step-N] [k=v ...]``."""

from __future__ import annotations

import argparse
import json

from tqdm import tqdm

from memsearcher.rl.config import GRPOConfig, SFTConfig, config_to_dict, load_config

_TRAINERS: dict[str, tuple[type[GRPOConfig] | type[SFTConfig], str]] = {
    "grpo": (GRPOConfig, "multi-context GRPO with the agent in the loop"),
    "ppo": (GRPOConfig, "PPO with a critic (MEM1's algorithm): GRPO's config with advantage=gae"),
    "sft": (SFTConfig, "supervised fine-tuning on trajectory JSONL (distillation baseline)"),
}


def add_train_command(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "train",
        help="train a policy (GRPO, PPO or SFT)",
        description="Train a policy. Runs as one process, or under torchrun / accelerate "
        "launch with one data-parallel rank per process.",
    )
    trainers = parser.add_subparsers(dest="trainer", required=True, metavar="TRAINER")
    for name, (_, help_text) in _TRAINERS.items():
        sub = trainers.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("--config", default=None, help="YAML preset (see configs/)")
        start = sub.add_mutually_exclusive_group()
        start.add_argument(
            "--resume", action="store_true", help="continue from the latest checkpoint"
        )
        start.add_argument(
            "--resume-from", type=_step, metavar="step-N",
            help="continue from this checkpoint (later ones are replaced as the run reaches them)",
        )  # fmt: skip
        sub.add_argument(
            "--print-config", action="store_true", help="print the resolved config and exit"
        )
        sub.add_argument(
            "overrides",
            nargs="*",
            metavar="KEY=VALUE",
            help="override a config field, dotted for sections: optim.lr=1e-5",
        )
        sub.set_defaults(func=_run)


def _step(text: str) -> int:
    step = text.removeprefix("step-")
    if not step.isdigit() or int(step) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: name a checkpoint as step-N (N >= 1)")
    return int(step)


def _run(args: argparse.Namespace) -> int:
    config_class, _ = _TRAINERS[args.trainer]
    resume = args.resume_from or args.resume
    # ppo's config is grpo's with the critic's advantage; a preset or an override may say so
    overrides = ["advantage=gae", *args.overrides] if args.trainer == "ppo" else args.overrides
    config: GRPOConfig | SFTConfig = load_config(config_class, args.config, overrides)
    if args.print_config:
        print(json.dumps(config_to_dict(config), indent=2))
        return 0
    if isinstance(config, GRPOConfig) and config.advantage == "gae":
        from memsearcher.rl.train_ppo import train_ppo

        train_ppo(config, resume=resume, echo=tqdm.write)
    elif isinstance(config, GRPOConfig):
        from memsearcher.rl.train_grpo import train_grpo

        train_grpo(config, resume=resume, echo=tqdm.write)
    else:
        from memsearcher.rl.train_sft import train_sft

        train_sft(config, resume=resume, echo=tqdm.write)
    print(f"checkpoints in {config.output_dir}")
    return 0
