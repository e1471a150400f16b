"""The shop's teacher: trajectories in each agent's shop protocol, for SFT, with stated flaws.

Like the QA oracle (``teach.oracle``), it is a `ScriptedLLM` reply function, so its
trajectories come out of the real shop agents, the real tokenizer and the real shop, with every
mask as in training. It knows each instruction's goal and target product. It reads the page it
is on off the prompt, and what it did so far off its own notes: the last non-empty ``<think>``
or ``<memory>`` in the prompt (MemSearcher's memory, or the thought of the last response that
MEM1 and ReAct still see). Its notes are events, ``searched <keywords>; opened <id>; chose
<value>``, written in each thought as they will stand after its action, and copied into
MemSearcher's memory.

The ideal shopper (every rate 0) shops as a reader of the pages can: it searches the goal's
attributes and type, and opens the first listed product whose title has the type and every
attribute and whose price is within the limit. On its page, if an option the instruction asks
for is not offered, it goes back (``< Prev``) and opens the next such product; else it clicks
each option and buys. Where a results page lists none it pages on, and where no page does it
searches the target's exact title. Which of several matching products it buys is not the
target's id, which no page gives away, but the first the pages show: a rule a model can learn.
The flaws hold for any instruction, so what reward teaches on one carries to all; each draw
is fixed by (seed, instruction, decision):

- ``vague_search``: the first search names only the product type ("t-shirt"), so a fitting
  product is rarely on the first results page and the teacher pages on to one: the long
  episodes;
- ``first_result``: on the first results page it opens the first product of the right type
  instead of reading the titles and prices (a near-duplicate, or the over-priced copy, unless
  that one fits);
- ``skip_options``: it buys without clicking the options.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from memsearcher.agent.environments.shop import (
    BACK_TO_SEARCH,
    BUY_NOW,
    NEXT_PAGE,
    PREV_PAGE,
    SEP,
)
from memsearcher.agent.environments.shop_world import (
    CATEGORIES,
    Catalogue,
    Goal,
    Instruction,
    Product,
)
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.scripted import Reply

__all__ = ["ShopFlaws", "page_of", "search_keywords", "shop_policy"]

_NOTES = re.compile(r"<(think|memory)>(.*?)</\1>", re.DOTALL)
_RESULTS = re.compile(r"Page (\d+) \(Total results: \d+\)")


@dataclass(frozen=True)
class ShopFlaws:
    """How the shop's teacher departs from the ideal shopper (every rate 0: the ideal one)."""

    vague_search: float = 0.0
    """Chance that the first search names only the product type."""
    first_result: float = 0.0
    """Chance of opening the first product of the right type on the first results page
    instead of the one that matches the instruction."""
    skip_options: float = 0.0
    """Chance of buying without clicking the options the instruction asks for."""
    seed: int = 0
    """Seeds the draws."""

    def draw(self, rate: float, instruction: str, decision: str) -> bool:
        if not rate:
            return False
        return random.Random(f"{self.seed}|{instruction}|{decision}").random() < rate


@dataclass(frozen=True)
class ShownPage:
    """What the teacher reads off one page's text."""

    kind: str
    """search, results or item."""
    instruction: str
    clickables: tuple[str, ...]
    """Product ids on a results page, in page order; option values on an item page."""
    number: int = 1
    """A results page's number."""
    has_next: bool = False


def page_of(prompt: str) -> ShownPage:
    """The last page in ``prompt``: every page starts its instruction with ``Instruction:``."""
    start = prompt.rindex("Instruction:" + SEP)
    texts = prompt[start:].split(SEP)
    instruction = texts[1]
    # the page ends where the prompt's markup resumes: a closing tag or a chat-template token
    rest = [re.split(r"</[a-z]+>|<\|", t)[0].strip() for t in texts[2:]]
    if rest and rest[0] == "Search":
        return ShownPage("search", instruction, ())
    shown = _RESULTS.fullmatch(rest[1]) if len(rest) > 1 else None
    if shown is not None:
        ids = tuple(t for t in rest if re.fullmatch(r"B0[0-9A-Z]{8}", t))
        return ShownPage("results", instruction, ids, int(shown.group(1)), NEXT_PAGE in rest)
    return ShownPage("item", instruction, ())


def shop_policy(catalogue: Catalogue, flaws: ShopFlaws = ShopFlaws()) -> Reply:
    """Reply as the shop's teacher for the instructions of ``catalogue`` (any split), in the
    protocol of whichever shop agent asks: an action, or (MemSearcher) the memory."""
    instructions = {i.text: i for i in catalogue.instructions}

    def reply(prompt: str, params: SamplingParams) -> str:
        notes = _notes(prompt)
        if "</memory>" in params.stop:
            return f"<memory> {'; '.join(notes)} </memory>"
        page = page_of(prompt)
        instruction = instructions[page.instruction]
        action, event = _next_action(catalogue, instruction, page, notes, flaws)
        thought = "; ".join([*notes, event] if event else notes) or "nothing done yet"
        return f"<think> {thought} </think>\n<action> {action} </action>"

    return reply


def _notes(prompt: str) -> list[str]:
    """The teacher's events so far: its last non-empty thought or memory in ``prompt``."""
    written = [body.strip() for _, body in _NOTES.findall(prompt) if body.strip()]
    if not written or written[-1] == "nothing done yet":
        return []
    return written[-1].split("; ")


def _next_action(
    catalogue: Catalogue,
    instruction: Instruction,
    page: ShownPage,
    notes: Sequence[str],
    flaws: ShopFlaws,
) -> tuple[str, str | None]:
    """The teacher's action on ``page``, and the event it adds to its notes (if any)."""
    goal, text = instruction.goal, instruction.text
    kind = CATEGORIES[goal.category].kind
    if page.kind == "search":
        searched = any(n.startswith("searched ") for n in notes)
        if searched:  # the target was not among the results: search its exact title
            keywords = catalogue.product(goal.asin).title.lower()
        elif flaws.draw(flaws.vague_search, text, "vague_search"):
            keywords = kind
        else:
            keywords = search_keywords(goal)
        return f"search[{keywords}]", f"searched {keywords}"
    opened = [n.removeprefix("opened ") for n in notes if n.startswith("opened ")]
    if page.kind == "results":
        fits = [a for a in page.clickables if a not in opened and _fits(catalogue.product(a), goal)]
        pick = fits[0] if fits else None
        if page.number == 1 and not opened and flaws.draw(flaws.first_result, text, "first_result"):
            same_kind = [
                a for a in page.clickables if catalogue.product(a).category == goal.category
            ]
            pick = same_kind[0] if same_kind else pick
        if pick is not None:
            return f"click[{pick}]", f"opened {pick}"
        if page.has_next:
            return f"click[{NEXT_PAGE}]", None
        return f"click[{BACK_TO_SEARCH}]", None
    offered = catalogue.product(opened[-1]).options
    if any(value not in offered.get(name, ()) for name, value in goal.options.items()):
        return f"click[{PREV_PAGE}]", None
    chosen = {n.removeprefix("chose ") for n in notes if n.startswith("chose ")}
    if not flaws.draw(flaws.skip_options, text, "skip_options"):
        for value in goal.options.values():
            if value not in chosen:
                return f"click[{value}]", f"chose {value}"
    return f"click[{BUY_NOW}]", None


def search_keywords(goal: Goal) -> str:
    """The ideal shopper's first search for ``goal``: its attributes and product type, as the
    instruction words them."""
    return " ".join([*goal.attributes, CATEGORIES[goal.category].kind])


def _fits(product: Product, goal: Goal) -> bool:
    """Whether a results page shows ``product`` as what ``goal`` asks for: its type, every
    attribute (all in its title) and a price within the limit."""
    return (
        product.category == goal.category
        and set(goal.attributes) <= set(product.attributes.values())
        and product.price <= goal.price_upper
    )
