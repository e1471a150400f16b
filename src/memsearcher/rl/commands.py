"""``memsearcher train grpo|ppo|sft --config FILE [--resume] [key=value ...]``."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from memsearcher.rl.config import GRPOConfig, SFTConfig, config_to_dict, load_config

_TRAINERS: dict[str, tuple[type[GRPOConfig] | type[SFTConfig], str]] = {
    "grpo": (GRPOConfig, "multi-context GRPO with the agent in the loop"),
    "ppo": (GRPOConfig, "PPO with a critic (MEM1's algorithm): the GRPO loop with advantage=gae"),
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
        sub.add_argument(
            "--resume", action="store_true", help="continue from the latest checkpoint"
        )
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


def _run(args: argparse.Namespace) -> int:
    config_class, _ = _TRAINERS[args.trainer]
    # ppo is grpo with the critic's advantage; a preset or an override may say so again
    overrides = ["advantage=gae", *args.overrides] if args.trainer == "ppo" else args.overrides
    config: GRPOConfig | SFTConfig = load_config(config_class, args.config, overrides)
    if args.print_config:
        print(json.dumps(config_to_dict(config), indent=2))
        return 0
    if isinstance(config, GRPOConfig):
        from memsearcher.rl.train_grpo import train_grpo

        train_grpo(config, resume=args.resume, echo=tqdm.write)
    else:
        assert isinstance(config, SFTConfig)
        _train_sft(config, args.resume)
    print(f"checkpoints in {config.output_dir}")
    return 0


def _train_sft(config: SFTConfig, resume: bool) -> None:
    """SFT, with the protocol data built first and the adapter exported after, if asked."""
    from memsearcher.rl.train_sft import train_sft

    if config.build is not None and not Path(config.data).is_file():
        from memsearcher.llm import load_tokenizer
        from memsearcher.llm.embedded import resolve_model
        from memsearcher.teach.protocol_data import build_protocol_data

        tokenizer = load_tokenizer(resolve_model(config.model.path))
        build_protocol_data(config.build, config.data, tokenizer, tqdm.write)
    started = time.perf_counter()
    train_sft(config, resume=resume, echo=tqdm.write)
    if config.export_adapter:
        from memsearcher.rl.export import export_trained_adapter

        folder = export_trained_adapter(config, time.perf_counter() - started)
        print(f"adapter written to {folder}")
