"""A scripted LLM: replies come from a Python function, token ids from a real tokenizer.

It exists for what a small untrained model cannot show: long protocol-conforming trajectories
for the context-growth benchmark, and turn-limit and memory-cap checks that need the model to
keep searching. Everything downstream of `generate` (the agents, the masks, the driver) runs
unchanged. It is never a stand-in for a real model in end-to-end tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from memsearcher.llm.base import Completion, SamplingParams, Tokenizer

Reply = Callable[[str, SamplingParams], str]
"""(prompt text, sampling params) -> the text the "model" writes."""


class ScriptedLLM:
    """An `LLM` whose reply text is chosen by ``reply``; stop strings, the token budget and
    the EOS token are applied exactly as a real backend applies them."""

    def __init__(self, tokenizer: Tokenizer, reply: Reply, max_context_tokens: int = 8192):
        self._tokenizer = tokenizer
        self.reply = reply
        self._max_context_tokens = max_context_tokens

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def max_context_tokens(self) -> int:
        return self._max_context_tokens

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Completion]:
        return [self._complete(self._tokenizer.decode(p), params) for p in prompts]

    def _complete(self, prompt: str, params: SamplingParams) -> Completion:
        text = self.reply(prompt, params)
        ends = [text.index(s) + len(s) for s in params.stop if s in text]
        if ends:
            ids = self._tokenizer.encode(text[: min(ends)])
        else:
            ids = self._tokenizer.encode(text) + [min(self._tokenizer.eos_token_ids)]
        if len(ids) > params.max_new_tokens:
            return Completion(tuple(ids[: params.max_new_tokens]), "length")
        return Completion(tuple(ids), "stop")
