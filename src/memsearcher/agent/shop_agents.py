"""The three agents in the shop (``environments.shop``): MemSearcher, MEM1 and ReAct, each with
its own protocol and prompts written for shopping.

A shop turn: the model thinks inside ``<think> </think>``, then acts, ``<action>
search[keywords] </action>`` or ``<action> click[text] </action>``, and the environment answers
with the next page in WebShop's text mode. Pages are the environment's text: loss mask 0, as
search results are. The episode opens by asking the environment for the instruction's start
page, and ends when the environment says so: at Buy Now, with WebShop's reward (on the
trajectory as ``environment_reward``, the bought product's id as its ``answer``), or at the
shop's step limit (reward 0, ``max_turns``); or as any episode ends, on a format error, the
turn limit or the context limit.

- **MemSearcher**: turn t sees the current page and its memory; after its action the next page
  comes back, and it rewrites the memory. Turn t+1 starts afresh from that page and memory, so
  its context holds one page, whatever the number of steps.
- **MEM1**: turn t sees the first message (instructions and the start page), its own previous
  response (internal state and action) and the page that action brought; everything older is
  pruned, as in its search protocol (``agent.mem1``).
- **ReAct**: one growing conversation of actions and pages.
"""

from __future__ import annotations

from abc import abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from memsearcher.agent.base import AgentConfig, Episode
from memsearcher.agent.environments import Page, ShopAction
from memsearcher.agent.parsing import ParseFailure, parse_shop_action
from memsearcher.agent.prompts import Templates, check_fields
from memsearcher.errors import MemSearcherError
from memsearcher.llm.base import Completion, Tokenizer
from memsearcher.types import QAExample

__all__ = [
    "SHOP_AGENTS",
    "Mem1ShopEpisode",
    "MemSearcherShopEpisode",
    "ReActShopEpisode",
    "ShopTemplates",
    "start_shop_episodes",
]

ACTION_STOP = ("</action>",)
MEMORY_STOP = ("</memory>",)

_ACTIONS = """\
You are shopping in a web shop for the instruction at the top of each page. A page is its \
texts separated by [SEP]; what you can click is its buttons, product ids and option values. \
First think step by step inside <think> </think>. Then write exactly one action inside \
<action> </action>:
- search[keywords], on the search page;
- click[text], where text is one of the page's clickables: click[Next >], click[< Prev], \
click[Back to Search], a product id, an option value, or click[Buy Now].
Buying ends the task: open the product that matches the instruction, click the options it \
asks for, check the price, then buy."""


@dataclass(frozen=True)
class ShopTemplates:
    """The texts of the shop agents; ``{name}`` fields are filled in at run time. A YAML or
    JSON file can override any of them (`prompts.read_templates`, ``templates`` in the RL
    config, ``eval --env shop --templates``)."""

    memsearcher_system: str = (
        _ACTIONS
        + """
You see the current page inside <page> </page> and your memory: notes you wrote after earlier \
pages. After your action the next page comes inside <page> </page>; then rewrite your memory \
inside <memory> </memory>: what you searched, which products you saw and why they do or do \
not match, which options you clicked. Only your memory and the current page are kept for the \
next step."""
    )
    memsearcher_user: str = "<memory> {memory} </memory>\n\n<page> {page} </page>"
    memsearcher_page: str = (
        "<page> {page} </page>\n\nNow rewrite your memory inside <memory> </memory>."
    )
    react_system: str = (
        _ACTIONS + "\nAfter each action the next page comes inside <page> </page>; then continue."
    )
    react_user: str = "<page> {page} </page>"
    react_page: str = "<page> {page} </page>"
    mem1_user: str = (
        _ACTIONS
        + """
At each step you see only this message, your previous step and the page it brought back, \
inside <information> </information>, so keep in <think> </think> a cumulative summary of \
everything you need: what you searched, the products seen, the options clicked.
Start page: {page}"""
    )
    mem1_information: str = "\n\n<information>{hint}\n\n{page}</information>\n\n"
    mem1_hint: str = "[HINT]You have {turns_left} turns left.[/HINT]"
    mem1_last_hint: str = "[HINT]You have 1 turn left. You must buy in the next turn.[/HINT]"

    def __post_init__(self) -> None:
        check_fields(self, _FIELDS)


_FIELDS = {
    "memsearcher_system": set(),
    "memsearcher_user": {"memory", "page"},
    "memsearcher_page": {"page"},
    "react_system": set(),
    "react_user": {"page"},
    "react_page": {"page"},
    "mem1_user": {"page"},
    "mem1_information": {"hint", "page"},
    "mem1_hint": {"turns_left"},
    "mem1_last_hint": set(),
}
"""The ``{fields}`` each shop template may use."""


class ShopEpisode(Episode[Page]):
    """What the three shop agents share: opening the session, acting, and ending on the
    environment's word."""

    def __init__(
        self,
        example: QAExample,
        tokenizer: Tokenizer,
        config: AgentConfig,
        shop: ShopTemplates,
        max_context_tokens: int | None,
        session: str | None = None,
    ) -> None:
        self.shop = shop
        self.session = example.id if session is None else session
        """The shop session this episode acts in (`ShopAction`): its own, though other
        episodes of the same instruction run beside it."""
        super().__init__(example, tokenizer, config, Templates(), max_context_tokens)

    def begin(self) -> None:
        self.page: Page | None = None
        self.pending = ShopAction(self.session, "")  # the start page

    def on_observation(self, page: Page) -> None:
        opened, self.page = self.page is None, page
        if opened:
            self.start(page.text)
        elif page.done:
            self.close_turn()
            self.finish(page)
        else:
            self.next_page(page.text)

    @abstractmethod
    def start(self, page: str) -> None:
        """Build the first context from the start page and ask for the first action."""

    @abstractmethod
    def next_page(self, page: str) -> None:
        """Take the page the pending action brought (the episode goes on)."""

    def act(self, completion: Completion) -> None:
        """Record the model's action and send it to the shop, or end the episode on a fault."""
        text = self.take_generation(completion)
        assert self.draft is not None
        self.draft.fields["action_text"] = text
        step = parse_shop_action(text)
        if isinstance(step, ParseFailure):
            if completion.finish_reason == "length":
                self.end("length", f"action cut at {self.config.max_new_tokens} tokens")
            else:
                self.end("format_error", f"{step.kind}: {step.detail}")
            return
        self.draft.fields["thought"] = step.think
        if step.action.lower().startswith("search["):
            self.draft.fields["query"] = step.action[len("search[") : -1].strip()
        self.pending = ShopAction(self.session, step.action)

    def finish(self, page: Page) -> None:
        self.environment_reward = page.reward
        if page.bought is not None:
            self.answer = page.bought
            self.end("answer")
        else:
            self.end("max_turns", "the shop's step limit")

    def out_of_turns(self) -> bool:
        if len(self.turns) >= self.config.max_turns:
            self.end("max_turns")
            return True
        return False


class MemSearcherShopEpisode(ShopEpisode):
    """Turn t: prompt = system + (memory, page); response = think + action, the next page
    (mask 0), then the rewritten memory. Each turn is its own training sequence."""

    agent_name = "memsearcher"

    def start(self, page: str) -> None:
        self.memory = ""
        self._begin_turn(page)

    def _begin_turn(self, page: str) -> None:
        user = self.shop.memsearcher_user.format(memory=self.memory, page=page)
        self.render_prompt(
            [
                {"role": "system", "content": self.shop.memsearcher_system},
                {"role": "user", "content": user},
            ]
        )
        self.start_turn()
        assert self.draft is not None
        self.draft.fields["memory"] = self.memory  # replaced if this turn rewrites it
        self.phase = "act"
        self.request_generation(self.config.max_new_tokens, ACTION_STOP)

    def on_generation(self, completion: Completion) -> None:
        if self.phase == "act":
            self.act(completion)
            return
        memory = self.take_memory(completion)
        if memory is None:
            return
        self.memory = memory
        self.close_turn()
        self.close_sequence()
        if not self.out_of_turns():
            assert self.page is not None
            self._begin_turn(self.page.text)

    def next_page(self, page: str) -> None:
        self.insert_user_message(self.shop.memsearcher_page.format(page=page))
        self.phase = "memory"
        self.request_generation(self.config.memory_tokens, MEMORY_STOP)


class ReActShopEpisode(ShopEpisode):
    """One growing conversation: the model's turns (mask 1) between the pages (mask 0)."""

    agent_name = "react"

    def start(self, page: str) -> None:
        user = self.shop.react_user.format(page=page)
        self.render_prompt(
            [
                {"role": "system", "content": self.shop.react_system},
                {"role": "user", "content": user},
            ]
        )
        self._begin_turn()

    def _begin_turn(self) -> None:
        self.start_turn()
        self.request_generation(self.config.max_new_tokens, ACTION_STOP)

    def on_generation(self, completion: Completion) -> None:
        self.act(completion)

    def next_page(self, page: str) -> None:
        self.insert_user_message(self.shop.react_page.format(page=page))
        self.close_turn()
        if not self.out_of_turns():
            self._begin_turn()


class Mem1ShopEpisode(ShopEpisode):
    """Turn t: prompt = the first message, then turn t-1's response and the page it brought;
    response = internal state + action (mask 1). Each turn is its own training sequence."""

    agent_name = "mem1"

    def start(self, page: str) -> None:
        self.render_prompt([{"role": "user", "content": self.shop.mem1_user.format(page=page)}])
        self.first_prompt = list(self.prompt_ids)
        self._begin_turn()

    def _begin_turn(self) -> None:
        self.start_turn()
        self.request_generation(self.config.max_new_tokens, ACTION_STOP)

    def on_generation(self, completion: Completion) -> None:
        self.act(completion)

    def next_page(self, page: str) -> None:
        response = list(self.response_ids)
        self.close_turn()
        self.close_sequence()
        turns_left = self.config.max_turns - len(self.turns)
        if turns_left <= 0:
            self.end("max_turns")
            return
        hint = (
            self.shop.mem1_last_hint
            if turns_left == 1
            else self.shop.mem1_hint.format(turns_left=turns_left)
        )
        observation = self.shop.mem1_information.format(hint=hint, page=page)
        # the pruning rule: the first prompt, the last response (its own ids), the page
        self.prompt_ids = self.first_prompt + response + self.tokenizer.encode(observation)
        self._begin_turn()


SHOP_AGENTS: dict[str, type[ShopEpisode]] = {
    "memsearcher": MemSearcherShopEpisode,
    "react": ReActShopEpisode,
    "mem1": Mem1ShopEpisode,
}


def start_shop_episodes(
    agent: str,
    examples: Sequence[QAExample],
    tokenizer: Tokenizer,
    config: AgentConfig | None = None,
    templates: ShopTemplates | None = None,
    max_context_tokens: int | None = None,
) -> list[ShopEpisode]:
    """One fresh shop episode of ``agent`` per instruction (as
    ``environments.shop.instruction_example`` makes them); 15 turns unless ``config`` says.

    The k-th episode of an instruction shops in session ``"<id>#<k>"``, so the episodes of
    one call (a GRPO group repeats each instruction) never share a session; episodes of two
    calls run against one environment at once would."""
    if agent not in SHOP_AGENTS:
        raise MemSearcherError(f"unknown agent {agent!r}; choose one of {sorted(SHOP_AGENTS)}")
    shop, config = templates or ShopTemplates(), config or AgentConfig(max_turns=15)
    seen: Counter[str] = Counter()
    episodes = []
    for example in examples:
        session = f"{example.id}#{seen[example.id]}"
        seen[example.id] += 1
        episodes.append(
            SHOP_AGENTS[agent](example, tokenizer, config, shop, max_context_tokens, session)
        )
    return episodes
