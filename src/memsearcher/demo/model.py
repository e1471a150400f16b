"""The demo's small model: a byte-level BPE tokenizer trained here and a Llama from scratch.

Both are saved as a normal HF folder (config, safetensors, tokenizer, chat template), so the
trainers, the agents and the evaluation load it through the same code paths as a real model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "ModelSize", "build_tokenizer", "save_demo_model"]

# ChatML, the format of SmolLM2 and Qwen2.5, so the glue between turns looks like theirs.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass(frozen=True)
class ModelSize:
    """Shape of the from-scratch Llama."""

    vocab: int = 2048
    """BPE vocabulary, special tokens included."""
    hidden: int = 128
    """Width of the residual stream."""
    layers: int = 4
    """Decoder layers."""
    heads: int = 4
    """Attention heads (as many key/value heads)."""
    head_dim: int | None = None
    """Width of each head; ``None`` is ``hidden / heads`` (32). 64 was tried: docs/demo.md."""
    max_positions: int = 2048
    """Longest sequence the position encoding is set up for."""


def build_tokenizer(texts: Iterable[str], vocab: int, names: Sequence[str] = ()) -> object:
    """A byte-level BPE trained on ``texts``, wrapped as a transformers fast tokenizer.

    Each of ``names`` becomes one token of its own, the same token wherever it stands (after a
    space, a quote or at the start of a line), so copying a name is copying one token.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    tokenizer.add_tokens([AddedToken(n, single_word=True, normalized=False) for n in names])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_demo_model(
    folder: str | Path, texts: Iterable[str], size: ModelSize, seed: int, names: Sequence[str] = ()
) -> Path:
    """Train the tokenizer on ``texts`` (``names`` one token each), initialize the model from
    ``seed``, save both."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = Path(folder)
    tokenizer = build_tokenizer(texts, size.vocab, names)
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # type: ignore[arg-type]
        hidden_size=size.hidden,
        intermediate_size=4 * size.hidden,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.heads,
        head_dim=size.head_dim,
        max_position_embeddings=size.max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,  # type: ignore[attr-defined]
        pad_token_id=tokenizer.pad_token_id,  # type: ignore[attr-defined]
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = config.pad_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)  # type: ignore[attr-defined]
    return folder
