"""The model's command-line options, declared once for every command that loads the LLM
(``eval``, ``ask``, ``serve``), and the LLM they describe."""

from __future__ import annotations

import argparse
import json
from typing import Any

from memsearcher.llm import BACKENDS, load_llm


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Options that pick the LLM backend and its model."""
    group = parser.add_argument_group("model")
    group.add_argument(
        "--model",
        default="embedded",
        help="'embedded' (SmolLM2-135M with its SFT and GRPO adapters), 'embedded-sft' (without "
        "GRPO's), 'embedded-protocol' (the earlier default), 'embedded-base' (the raw model), "
        "an HF folder or hub id; with --backend openai it gives the tokenizer",
    )
    group.add_argument("--backend", choices=sorted(BACKENDS), default="hf", help="default: hf")
    group.add_argument(
        "--base-url", default=None, help="OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1"
    )
    group.add_argument("--served-model", default=None, help="model name the server knows")
    group.add_argument(
        "--api",
        choices=("auto", "completions", "chat"),
        default="auto",
        help="openai backend: token-exact /v1/completions, or chat; auto tries completions first",
    )
    group.add_argument("--tokenizer", default=None, help="tokenizer folder (default: --model)")
    group.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="openai backend: the server's context length, where /v1/models does not say",
    )
    group.add_argument(
        "--chat-template-kwargs",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="variables for the chat template, e.g. '{\"enable_thinking\": false}' for Qwen3",
    )
    group.add_argument("--device", default="auto")
    group.add_argument("--batch-size", type=int, default=16, help="prompts per forward (hf)")
    group.add_argument("--gpu-memory", type=float, default=0.85, help="vllm memory fraction")


def open_llm(args: argparse.Namespace) -> Any:
    """The LLM the backend options describe."""
    return load_llm(
        args.model,
        device=args.device,
        batch_size=args.batch_size,
        backend=args.backend,
        base_url=args.base_url,
        served_model=args.served_model,
        api=args.api,
        tokenizer=args.tokenizer,
        gpu_memory=args.gpu_memory,
        concurrency=getattr(args, "concurrency", 64),
        max_context_tokens=args.max_context,
        chat_template_kwargs=args.chat_template_kwargs,
    )


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value
