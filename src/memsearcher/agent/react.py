"""The ReAct baseline: one growing conversation, every thought and passage appended."""

from __future__ import annotations

from collections.abc import Sequence

from memsearcher.agent.base import ACTION_STOP, Episode
from memsearcher.agent.prompts import format_hits, format_tools, question_text
from memsearcher.llm.base import Completion
from memsearcher.types import Hit


class ReActEpisode(Episode[Sequence[Hit]]):
    """Same tags as MemSearcher, no memory: the whole trajectory is one training sequence whose
    response interleaves the model's turns (mask 1) with tool responses (mask 0)."""

    agent_name = "react"
    answers_on_repeat = True

    def begin(self) -> None:
        system = self.templates.react_system.format(tools=format_tools(self.config.top_n))
        user = self.templates.react_user.format(
            question=question_text(self.example, self.templates)
        )
        self.render_prompt(
            [{"role": "system", "content": system}, {"role": "user", "content": user}]
        )
        self._begin_turn()

    def _begin_turn(self) -> None:
        self.start_turn()
        self.request_generation(self.config.max_new_tokens, ACTION_STOP)

    def on_generation(self, completion: Completion) -> None:
        self.take_action(completion)

    def on_observation(self, hits: Sequence[Hit]) -> None:
        assert self.draft is not None
        self.draft.fields["hits"] = tuple(hits)
        self.insert_user_message(
            self.templates.react_tool_response.format(passages=format_hits(hits))
        )
        self.close_turn()
        if len(self.turns) >= self.config.max_turns:
            self.end("max_turns")
        else:
            self._begin_turn()
