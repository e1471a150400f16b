"""The transformers backend: batched generation with left padding and a KV cache."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from memsearcher.errors import MemSearcherError
from memsearcher.llm.base import Completion, SamplingParams, derive_seed
from memsearcher.llm.decode import decode

logger = logging.getLogger(__name__)

# a message's content in a rendering, between private-use code points that no template or
# tokenizer gives a meaning to
_MARK = "\ue000{}\ue001"
_MARKS = re.compile("\ue000(\\d+)\ue001")

Part = tuple[str, int | None]
"""A stretch of a rendered chat: its text, and the index of the message whose content it is
(None: the template's own text)."""


class HFTokenizer:
    """A transformers tokenizer seen through the `Tokenizer` protocol.

    ``chat_template_kwargs`` go to every ``apply_chat_template`` call, as veRL's
    ``data.apply_chat_template_kwargs`` do: variables the template reads, such as Qwen3's
    ``enable_thinking``.
    """

    def __init__(
        self,
        tokenizer: Any,
        extra_eos_ids: Sequence[int] = (),
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if tokenizer.chat_template is None:
            raise MemSearcherError("the tokenizer has no chat template; use an instruct model")
        self.hf = tokenizer
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        ids = {tokenizer.eos_token_id, *extra_eos_ids} - {None}
        self._eos_token_ids = frozenset(int(i) for i in ids)
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self._special = {t.content: int(i) for i, t in added.items() if t.special}
        names = sorted(self._special, key=len, reverse=True)  # longest first, as the tokenizer
        self._special_split = re.compile(f"({'|'.join(map(re.escape, names))})") if names else None

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def pad_token_id(self) -> int:
        pad = self.hf.pad_token_id
        return int(pad if pad is not None else min(self._eos_token_ids))

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return str(
            self.hf.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        )

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool) -> str:
        return str(
            self.hf.apply_chat_template(
                list(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **self.chat_template_kwargs,
            )
        )

    def encode_chat(
        self,
        messages: Sequence[dict[str, str]],
        add_generation_prompt: bool,
        after: int | None = None,
    ) -> list[int]:
        """Token ids of ``render_chat(messages)``, decoding to exactly that text; the template's
        special tokens are special, and in the messages' contents a special token's text stays
        text. ``after=k``: only the ids of what follows message k's content.

        Segments between the template's special tokens are encoded whole, as ``encode`` does
        for the full text, so text without special tokens gets the same ids as ``encode``.
        """
        parts = self._chat_parts(messages, add_generation_prompt)
        if parts is None:  # the template rewrites contents: encode as text if that is safe
            return self._encode_unparted(messages, add_generation_prompt, after)
        if after is not None:
            last = max(k for k, (_, message) in enumerate(parts) if message == after)
            parts = parts[last + 1 :]
        ids: list[int] = []
        pending: list[str] = []

        def flush() -> None:
            if pending:
                text = "".join(pending)
                ids.extend(
                    self.hf.encode(text, add_special_tokens=False, split_special_tokens=True)
                )
                pending.clear()

        for text, message in parts:
            if message is not None or self._special_split is None:
                pending.append(text)
                continue
            for piece in self._special_split.split(text):
                if piece in self._special:
                    flush()
                    ids.append(self._special[piece])
                elif piece:
                    pending.append(piece)
        flush()
        return ids

    def _encode_unparted(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool, after: int | None
    ) -> list[int]:
        if self._special_split is not None and any(
            self._special_split.search(m["content"]) for m in messages
        ):
            raise MemSearcherError(
                "this chat template changes the text it is given, so the special tokens written "
                "in a message could not be kept as text; refusing to encode them as control tokens"
            )
        text = self.render_chat(messages, add_generation_prompt)
        if after is not None:
            content = messages[after]["content"]
            text = text[text.index(content) + len(content) :]
        return self.encode(text)

    def _chat_parts(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool
    ) -> list[Part] | None:
        """The rendering cut into template text and message contents, found by rendering once
        more with a marker for each content (and trimmed contents, for templates that trim)."""
        text = self.render_chat(messages, add_generation_prompt)
        marked = [{**m, "content": _MARK.format(k)} for k, m in enumerate(messages)]
        pieces = _MARKS.split(self.render_chat(marked, add_generation_prompt))
        order = [int(k) for k in pieces[1::2]]
        if sorted(order) == list(range(len(messages))):
            for shape in (str, str.strip):
                parts: list[Part] = []
                for k, piece in enumerate(pieces):
                    parts.append((piece, None) if k % 2 == 0 else
                                 (shape(messages[int(piece)]["content"]), int(piece)))  # fmt: skip
                if "".join(t for t, _ in parts) == text:
                    return [(t, m) for t, m in parts if t or m is not None]
        return None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class HFModel:
    """An `LLM` over a transformers causal LM, on CPU or one GPU.

    Prompts are sorted by length and generated in chunks of ``batch_size`` so that left padding
    stays small; results come back in the caller's order. With a seed, the first chunk draws
    from it and chunk k from ``derive_seed(seed, k)``.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        batch_size: int = 32,
        share_prefix: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.model = model
        extra_eos = model.generation_config.eos_token_id
        extra_eos = [extra_eos] if isinstance(extra_eos, int) else list(extra_eos or [])
        self._tokenizer = HFTokenizer(tokenizer, extra_eos, chat_template_kwargs)
        self.batch_size = batch_size
        self.share_prefix = share_prefix
        """Compute the prompt prefix a batch shares once (`memsearcher.llm.decode`)."""

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 32,
        share_prefix: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> HFModel:
        """Load an HF folder or hub id (hub ids need network access, which tests never have)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target = resolve_device(device)
        if dtype == "auto":
            # bfloat16 halves GPU memory; CPUs are fastest and exact in float32.
            torch_dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
        else:
            torch_dtype = getattr(torch, dtype)
        try:
            tokenizer = AutoTokenizer.from_pretrained(name_or_path)
            model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype)
        except OSError as error:
            raise MemSearcherError(f"cannot load model {name_or_path!r}: {error}") from error
        model.to(target)  # type: ignore[arg-type]  # transformers wraps .to for PreTrainedModel
        model.eval()
        return cls(model, tokenizer, batch_size, share_prefix, chat_template_kwargs)

    @property
    def tokenizer(self) -> HFTokenizer:
        return self._tokenizer

    @property
    def max_context_tokens(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def device(self) -> torch.device:
        return torch.device(self.model.device)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Completion]:
        if params.seed is not None:
            torch.manual_seed(params.seed)
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[Completion | None] = [None] * len(prompts)
        for number, start in enumerate(range(0, len(order), self.batch_size)):
            chunk = order[start : start + self.batch_size]
            seed = params.seed
            if seed is not None and number > 0:  # restarting the call's seed repeats chunk 0
                seed = derive_seed(seed, number)
            batch = [prompts[i] for i in chunk]
            completions = self._generate_batch(batch, replace(params, seed=seed))
            for i, completion in zip(chunk, completions, strict=True):
                results[i] = completion
        return [c for c in results if c is not None]

    def _generate_batch(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Completion]:
        window = max((len(s) for s in params.stop), default=0) + 1

        def stopped(tokens: list[int]) -> bool:
            # a stop string the newest token completed spans at most its length in tokens
            if not params.stop:
                return False
            tail = self._tokenizer.decode(tokens[-window:])
            return any(s in tail for s in params.stop)

        eos, pad = self._tokenizer.eos_token_ids, self._tokenizer.pad_token_id
        generated = decode(self.model, prompts, params, eos, pad, stopped, self.share_prefix)
        return [self._finish(row, params) for row in generated]

    def _finish(self, tokens: list[int], params: SamplingParams) -> Completion:
        """One row's completion: cut right after the token that completed a stop string, or
        after the EOS token (a stop string is looked for first, and only before the EOS)."""
        eos = self._tokenizer.eos_token_ids
        first_eos = next((k for k, t in enumerate(tokens) if t in eos), len(tokens))
        stop_end = self._stop_string_end(tokens[:first_eos], params.stop)
        if stop_end is not None:
            return Completion(tuple(tokens[:stop_end]), "stop")
        if first_eos < len(tokens):
            return Completion(tuple(tokens[: first_eos + 1]), "stop")
        return Completion(tuple(tokens), "length")

    def _stop_string_end(self, tokens: list[int], stop: Sequence[str]) -> int | None:
        """The shortest prefix length of ``tokens`` whose text contains a stop string."""

        def contains_stop(n: int) -> bool:
            text = self._tokenizer.decode(tokens[:n])
            return any(s in text for s in stop)

        if not stop or not contains_stop(len(tokens)):
            return None
        low, high = 1, len(tokens)  # contains_stop is monotone in the prefix length
        while low < high:
            middle = (low + high) // 2
            if contains_stop(middle):
                high = middle
            else:
                low = middle + 1
        return low
