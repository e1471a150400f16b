"""The shop's teacher (`memsearcher.teach.shop`), through the real shop agents, the real
lockstep driver, the embedded tokenizer and the seeded shop with its BM25 search.

Without flaws it buys every instruction right, with the same actions in all three protocols;
with flaws, each departure happens at its stated rate, within sampling error, as measured by
replaying the trajectories' actions in a fresh `ShopEnv`.
"""

from __future__ import annotations

import math

import pytest

from memsearcher.agent import AgentConfig, run_lockstep
from memsearcher.agent.environments.shop import (
    PREV_PAGE,
    ShopEnv,
    ShopEnvironment,
    ShopSearch,
    instruction_example,
)
from memsearcher.agent.environments.shop_world import (
    CATEGORIES,
    Catalogue,
    Goal,
    Product,
    ShopConfig,
    generate_catalogue,
)
from memsearcher.agent.parsing import ShopStep, parse_shop_action
from memsearcher.agent.shop_agents import start_shop_episodes
from memsearcher.llm import load_tokenizer
from memsearcher.llm.base import SamplingParams, Tokenizer
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.teach.shop import ShopFlaws, page_of, shop_policy
from memsearcher.types import Trajectory

AGENTS = ("memsearcher", "mem1", "react")


@pytest.fixture(scope="module")
def shop() -> tuple[Catalogue, ShopSearch]:
    catalogue = generate_catalogue(ShopConfig(seed=5, families_per_category=4))
    return catalogue, ShopSearch(catalogue.products)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from memsearcher.llm.embedded import embedded_model_path

    return load_tokenizer(str(embedded_model_path()))


def teach(
    shop: tuple[Catalogue, ShopSearch], tokenizer: Tokenizer, agent: str, flaws: ShopFlaws
) -> list[Trajectory]:
    catalogue, search = shop
    examples = [instruction_example(i) for i in catalogue.instructions]
    episodes = start_shop_episodes(agent, examples, tokenizer, AgentConfig(max_turns=15))
    teacher = ScriptedLLM(tokenizer, shop_policy(catalogue, flaws))
    return run_lockstep(episodes, teacher, ShopEnvironment(catalogue, search), SamplingParams())


def actions(trajectory: Trajectory) -> list[str]:
    steps = [parse_shop_action(turn.action_text) for turn in trajectory.turns]
    return [step.action for step in steps if isinstance(step, ShopStep)]


def test_the_ideal_teacher_buys_every_instruction_right_in_each_protocol(
    shop: tuple[Catalogue, ShopSearch], tokenizer: Tokenizer
) -> None:
    runs = {agent: teach(shop, tokenizer, agent, ShopFlaws()) for agent in AGENTS}
    catalogue = shop[0]
    for agent, trajectories in runs.items():
        assert len(trajectories) == len(catalogue.instructions)
        for trajectory in trajectories:
            assert trajectory.end_reason == "answer", (agent, trajectory.error)
            assert trajectory.environment_reward == 1.0
    # it reads the pages: every product it opens fits the goal by title and price, and where
    # one lacks an asked option it goes back and opens the next
    went_back = 0
    for instruction, trajectory in zip(catalogue.instructions, runs["mem1"], strict=True):
        taken = actions(trajectory)
        opened = [a[6:-1] for a in taken if a.startswith("click[B0")]
        assert all(fits(catalogue.product(a), instruction.goal) for a in opened)
        went_back += taken.count(f"click[{PREV_PAGE}]")
    assert went_back > 0
    for trajectories in zip(*runs.values(), strict=True):  # the same actions in all three
        assert len({tuple(actions(t)) for t in trajectories}) == 1
    # MemSearcher's memory is the teacher's notes: after the last option, what it did so far
    memsearcher = runs["memsearcher"][0]
    goal = catalogue.instructions[0].goal
    memory = memsearcher.turns[-2].memory
    bought = [a for a in actions(memsearcher) if a.startswith("click[B0")][-1][6:-1]
    assert memory.startswith("searched ") and f"opened {bought}" in memory
    assert all(f"chose {value}" in memory for value in goal.options.values())


def fits(product: Product, goal: Goal) -> bool:
    """Whether the results page's title and price show ``product`` as what ``goal`` asks."""
    title = product.title.lower()
    return (
        CATEGORIES[goal.category].kind.lower() in title
        and all(value.lower() in title for value in goal.attributes)
        and product.price <= goal.price_upper
    )


def within_sampling_error(hits: int, trials: int, rate: float) -> bool:
    """Whether ``hits`` of ``trials`` is within 3.3 standard errors (99.9%) of ``rate``."""
    return abs(hits / trials - rate) <= 3.3 * math.sqrt(rate * (1 - rate) / trials)


def test_each_flaw_happens_at_its_stated_rate(tokenizer: Tokenizer) -> None:
    """On 288 instructions, each flaw is counted from what the teacher did: the first search's
    keywords, the product it opened on the first results page where the first product of the
    goal's type there does not fit the goal (so the ideal shopper would open another), and
    whether it bought with options unclicked. The pages come from
    replaying the actions in a fresh `ShopEnv`, not from the teacher's own reading."""
    catalogue = generate_catalogue(ShopConfig(seed=6, instructions_per_product=6))
    search = ShopSearch(catalogue.products)
    flaws = ShopFlaws(vague_search=0.3, first_result=0.4, skip_options=0.25, seed=1)
    trajectories = teach((catalogue, search), tokenizer, "mem1", flaws)
    counts = {name: [0, 0] for name in ("vague_search", "first_result", "skip_options")}

    def count(name: str, hit: bool) -> None:
        counts[name][0] += hit
        counts[name][1] += 1

    for instruction, trajectory in zip(catalogue.instructions, trajectories, strict=True):
        assert trajectory.end_reason == "answer"
        goal, env = instruction.goal, ShopEnv(catalogue, search, instruction)
        env.reset()
        taken = actions(trajectory)
        count("vague_search", taken[0] == f"search[{CATEGORIES[goal.category].kind}]")
        for action in taken:
            page = page_of(env.observation())
            if page.kind == "results":  # the first results page: what the teacher opens there
                first = [
                    a for a in page.clickables if catalogue.product(a).category == goal.category
                ]
                if not fits(catalogue.product(first[0]), goal):
                    count("first_result", action == f"click[{first[0]}]")
                break
            env.step(action)
        options = {f"click[{value}]" for value in goal.options.values()}
        count("skip_options", not options & set(taken))
    assert min(trials for _, trials in counts.values()) >= 80
    for name, (hits, trials) in counts.items():
        assert within_sampling_error(hits, trials, getattr(flaws, name)), (name, hits, trials)
