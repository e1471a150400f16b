"""MEM1 (Zhou et al., ICLR 2026): the internal state ``<think>`` is the only memory.

The protocol, as the release runs it (MIT-MI/MEM1, ``train/rollout/llm_agent/
generation_think.py``): each turn the model writes its internal state ``<think> ... </think>``,
a cumulative summary that also carries its reasoning, then ``<search> query </search>`` or
``<answer> a1; a2 </answer>``. The observation comes back as ``<information>[HINT]You have N
turns left.[/HINT] Doc 1 ... </information>``, appended to the response as it is, inside the
same assistant message. The next turn's context is the prompt, the previous response and that
observation; everything older is pruned.

Unlike the release, which decodes each response and tokenizes the text again, the previous
response enters the next context as the token ids the model generated, so every turn's
training sequence is exactly what the model was conditioned on.
"""

from __future__ import annotations

from collections.abc import Sequence

from memsearcher.agent.base import Episode
from memsearcher.agent.environments import Search
from memsearcher.agent.parsing import FinalAnswer, ParseFailure, parse_mem1_action
from memsearcher.agent.prompts import format_hits, mem1_hint
from memsearcher.llm.base import Completion
from memsearcher.types import Hit

__all__ = ["MEM1_STOP", "Mem1Episode"]

MEM1_STOP = ("</search>", "</answer>")


class Mem1Episode(Episode[Sequence[Hit]]):
    """Turn t: prompt = the user message (instructions and questions), then turn t-1's
    response and observation; response = internal state + action, all generated (mask 1).
    Each turn is its own training sequence, so the context stays flat."""

    agent_name = "mem1"

    def begin(self) -> None:
        user = self.templates.mem1_user.format(questions=self.example.question)
        self.render_prompt([{"role": "user", "content": user}])
        self.first_prompt = list(self.prompt_ids)
        self._begin_turn()

    def _begin_turn(self) -> None:
        self.start_turn()
        self.request_generation(self.config.max_new_tokens, MEM1_STOP)

    def on_generation(self, completion: Completion) -> None:
        text = self.take_generation(completion)
        assert self.draft is not None
        self.draft.fields["action_text"] = text
        parsed = parse_mem1_action(text)
        if isinstance(parsed, ParseFailure):
            if completion.finish_reason == "length":
                self.end("length", f"response cut at {self.config.max_new_tokens} tokens")
            else:
                self.end("format_error", f"{parsed.kind}: {parsed.detail}")
            return
        self.draft.fields["thought"] = parsed.think
        if isinstance(parsed.action, FinalAnswer):
            self.draft.fields["answer"] = parsed.action.answer
            self.answer = parsed.action.answer
            self.end("answer")
            return
        self.draft.fields["query"] = parsed.action.query
        self.pending = Search(parsed.action.query, self.config.top_n)

    def on_observation(self, hits: Sequence[Hit]) -> None:
        assert self.draft is not None
        self.draft.fields["hits"] = tuple(hits)
        response = list(self.response_ids)
        self.close_turn()
        self.close_sequence()
        turns_left = self.config.max_turns - len(self.turns)
        if turns_left <= 0:
            self.end("max_turns")
            return
        observation = self.templates.mem1_information.format(
            hint=mem1_hint(self.templates, turns_left), passages=format_hits(hits)
        )
        # The pruning rule: the first prompt, the last response (its own ids), the observation.
        self.prompt_ids = self.first_prompt + response + self.tokenizer.encode(observation)
        self._begin_turn()
