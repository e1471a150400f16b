"""A tiny Llama with the embedded SmolLM2 tokenizer, saved as an HF folder, for trainer tests.

It is a real transformers model (random weights from a config, nothing downloaded), small
enough that forward and backward passes over agent-length sequences take milliseconds.
"""

from __future__ import annotations

from pathlib import Path


def save_tiny_model(folder: Path, seed: int = 0, hidden: int = 64, layers: int = 2) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from memsearcher.llm.embedded import embedded_model_path

    if (folder / "config.json").is_file():
        return folder
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
"""Qwen3's switch in ChatML: ``enable_thinking=False`` opens the answer with an empty think."""


def save_thinking_model(folder: Path) -> Path:
    """`save_tiny_model` whose chat template reads ``enable_thinking``, as Qwen3's does."""
    from transformers import AutoTokenizer

    save_tiny_model(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(folder)
    return folder
