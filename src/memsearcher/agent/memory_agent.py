"""MemSearcher: each turn sees only the question and a short memory the model rewrites itself."""

from __future__ import annotations

from collections.abc import Sequence

from memsearcher.agent.base import ACTION_STOP, MEMORY_STOP, Episode
from memsearcher.agent.prompts import format_hits, format_tools, question_text
from memsearcher.llm.base import Completion
from memsearcher.types import Hit


class MemSearcherEpisode(Episode[Sequence[Hit]]):
    """Turn t: prompt = system + (question, memory); response = think + tool call, the tool
    response (mask 0), then the rewritten memory; or think + answer on the last turn.
    Each turn is its own training sequence, so the context stays flat."""

    agent_name = "memsearcher"
    answers_on_repeat = True

    def begin(self) -> None:
        self.memory = ""
        self.phase = "act"
        self._begin_turn()

    def _begin_turn(self) -> None:
        system = self.templates.memsearcher_system.format(tools=format_tools(self.config.top_n))
        user = self.templates.memsearcher_user.format(
            question=question_text(self.example, self.templates), memory=self.memory
        )
        self.render_prompt(
            [{"role": "system", "content": system}, {"role": "user", "content": user}]
        )
        self.start_turn()
        assert self.draft is not None
        self.draft.fields["memory"] = self.memory  # replaced if this turn rewrites it
        self.phase = "act"
        self.request_generation(self.config.max_new_tokens, ACTION_STOP)

    def on_generation(self, completion: Completion) -> None:
        if self.phase == "act":
            self.take_action(completion)  # sets a Search, or ends the episode
            return
        memory = self.take_memory(completion)
        if memory is None:
            return
        self.memory = memory
        self.close_turn()
        self.close_sequence()
        if len(self.turns) >= self.config.max_turns:
            self.end("max_turns")
        else:
            self._begin_turn()

    def on_observation(self, hits: Sequence[Hit]) -> None:
        assert self.draft is not None
        self.draft.fields["hits"] = tuple(hits)
        self.insert_user_message(
            self.templates.memsearcher_tool_response.format(passages=format_hits(hits))
        )
        self.phase = "memory"
        self.request_generation(self.config.memory_tokens, MEMORY_STOP)
