"""The three agents in the shop, through the environment protocol and the real lockstep driver.

A scripted model plays the oracle's actions (``solve``) in each agent's protocol, on the real
embedded tokenizer and its chat template, against `ShopEnvironment` over the seeded catalogue
and its real BM25 search. Every test instruction is bought with reward 1; the pages are the
environment's tokens (mask 0); MemSearcher's and MEM1's contexts stay flat while ReAct's grows
with each page.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

from memsearcher.agent import AgentConfig, run_lockstep
from memsearcher.agent.environments.shop import (
    SEP,
    ShopEnv,
    ShopEnvironment,
    ShopSearch,
    instruction_example,
    solve,
)
from memsearcher.agent.environments.shop_world import ShopConfig, generate_catalogue
from memsearcher.agent.parsing import parse_shop_action
from memsearcher.agent.shop_agents import start_shop_episodes
from memsearcher.errors import MemSearcherError
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.hf import HFModel
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.types import Trajectory

AGENTS = ("memsearcher", "mem1", "react")


@pytest.fixture(scope="module")
def shop() -> dict[str, Any]:
    catalogue = generate_catalogue(ShopConfig(seed=3, families_per_category=2))
    search = ShopSearch(catalogue.products)
    test = catalogue.split("test")
    plans = {i.text: solve(ShopEnv(catalogue, search, i)) for i in test}
    return {"catalogue": catalogue, "search": search, "test": test, "plans": plans}


def oracle(plans: dict[str, list[str]]) -> Any:
    """The oracle's next action, read off the prompt: the instruction (on every page) says
    which plan; the steps done so far say where in it: MemSearcher's memory counts them, and
    MEM1's and ReAct's contexts hold the last response, whose thought counts them."""
    instruction_text = re.compile("Instruction:" + re.escape(SEP) + "(.*?)" + re.escape(SEP))

    def reply(prompt: str, params: SamplingParams) -> str:
        plan = plans[instruction_text.findall(prompt)[0]]
        memory = re.findall(r"<memory> step (\d+)", prompt)
        if "</memory>" in params.stop:
            return f"<memory> step {int(memory[-1]) + 1 if memory else 1} </memory>"
        thoughts = re.findall(r"<think> step (\d+)", prompt)
        done = int(memory[-1]) if memory else int(thoughts[-1]) + 1 if thoughts else 0
        return f"<think> step {done} </think>\n<action> {plan[done]} </action>"

    return reply


def run(shop: dict[str, Any], llm: HFModel, agent: str) -> list[Trajectory]:
    examples = [instruction_example(i) for i in shop["test"]]
    model = ScriptedLLM(llm.tokenizer, oracle(shop["plans"]))
    episodes = start_shop_episodes(agent, examples, llm.tokenizer, AgentConfig(max_turns=15))
    environment = ShopEnvironment(shop["catalogue"], shop["search"])
    trajectories = run_lockstep(episodes, model, environment, SamplingParams())
    assert environment.sessions == {}  # every session closed at its end
    return trajectories


@pytest.mark.parametrize("agent", AGENTS)
def test_every_test_instruction_is_bought_right_by_each_agent(
    shop: dict[str, Any], llm: HFModel, agent: str
) -> None:
    trajectories = run(shop, llm, agent)
    assert len(trajectories) == len(shop["test"]) > 0
    for trajectory, instruction in zip(trajectories, shop["test"], strict=True):
        assert trajectory.end_reason == "answer", trajectory.error
        assert trajectory.environment_reward == 1.0 and trajectory.answer == instruction.goal.asin
        plan = shop["plans"][instruction.text]
        actions = [parse_shop_action(t.action_text) for t in trajectory.turns]
        assert [a.action for a in actions if not isinstance(a, Exception)] == plan
        assert trajectory.turns[0].query  # the first action is a search


def test_pages_are_the_environments_tokens(shop: dict[str, Any], llm: HFModel) -> None:
    """Loss mask 1 covers what the model wrote and nothing of a page; every page but the start
    page (in the first prompt) is in the mask-0 tokens once (MemSearcher, ReAct) or in the
    next turn's prompt (MEM1, whose responses are all its own)."""
    decode = llm.tokenizer.decode
    for agent in AGENTS:
        for trajectory in run(shop, llm, agent):
            pages = len(trajectory.turns) - 1  # the last action buys: no page after it
            masked, written = [], []
            for s in trajectory.sequences:
                masked += [t for t, m in zip(s.response_ids, s.loss_mask, strict=True) if not m]
                written += [t for t, m in zip(s.response_ids, s.loss_mask, strict=True) if m]
            assert "Instruction:" not in decode(written)
            if agent == "mem1":
                assert not masked
                prompts = [decode(s.prompt_ids).count("Instruction:") for s in trajectory.sequences]
                assert prompts == [1] + [2] * pages  # the start page, and the last page
            else:
                assert decode(masked).count("Instruction:") == pages


def test_memory_agents_keep_a_flat_context_while_reacts_grows(
    shop: dict[str, Any], llm: HFModel
) -> None:
    """Per turn, the tokens of the context each agent saw. Seed 3's plans are 5-6 steps
    (search, product, options, buy); measured: MemSearcher 324, 742, 406, 406, 406 (its peak
    is the results page), MEM1 298, 824, 487, 479, 479, ReAct 247, 763, 942, 1113, 1284."""
    contexts = {
        a: [[t.prompt_tokens for t in tr.turns] for tr in run(shop, llm, a)] for a in AGENTS
    }
    for i in range(len(shop["test"])):
        react = contexts["react"][i]
        assert len(react) >= 5 and all(b > a for a, b in zip(react, react[1:], strict=False))
        for agent in ("memsearcher", "mem1"):
            flat = contexts[agent][i]
            assert max(flat[2:]) <= flat[1]  # no growth after the results page
            assert flat[-1] <= 0.5 * react[-1]


def test_an_unknown_agent_or_session_is_refused(shop: dict[str, Any], llm: HFModel) -> None:
    with pytest.raises(MemSearcherError, match="unknown agent"):
        start_shop_episodes("nobody", [], llm.tokenizer)
    environment = ShopEnvironment(shop["catalogue"], shop["search"])
    from memsearcher.agent.environments import ActionRefused, ShopAction

    with pytest.raises(MemSearcherError, match="no instruction 'no-such-instruction'"):
        environment.act([ShopAction("no-such-instruction", "")])  # the tasks of another shop
    (never_opened,) = environment.act([ShopAction(shop["test"][0].id, "click[buy now]")])
    assert isinstance(never_opened, ActionRefused)


def test_a_group_of_one_instruction_gets_a_session_per_episode(
    shop: dict[str, Any], llm: HFModel
) -> None:
    """GRPO runs G episodes of the same instruction in one lockstep run. Each must shop in a
    session of its own: here the first of three buys by the oracle's plan while the others
    go back and forth between the search page and a search; in one shared session their
    actions would land on each other's pages (a search on the results page is invalid) and
    the buyer's Buy Now would close the browsers' session under them."""
    instruction = shop["test"][0]
    plan = shop["plans"][instruction.text]
    roles = iter(["buyer", "browser", "browser"])  # the first round's prompts, in order

    def reply(prompt: str, params: SamplingParams) -> str:
        known = re.findall(r"<(?:memory|think)> (buyer|browser) step (\d+)", prompt)
        role, done = (known[-1][0], int(known[-1][1])) if known else (next(roles), 0)
        if "</memory>" in params.stop:
            return f"<memory> {role} step {done + 1} </memory>"
        if role == "buyer" and done < len(plan):
            action = plan[done]
        elif role == "buyer":
            action = "click[back to search]"  # only if its Buy Now was not the last action
        else:
            action = "search[t-shirt]" if done % 2 == 0 else "click[back to search]"
        return f"<think> {role} step {done} </think>\n<action> {action} </action>"

    examples = [instruction_example(instruction)] * 3
    episodes = start_shop_episodes("memsearcher", examples, llm.tokenizer, AgentConfig(8))
    environment = ShopEnvironment(shop["catalogue"], shop["search"])
    model = ScriptedLLM(llm.tokenizer, reply)
    buyer, *browsers = run_lockstep(episodes, model, environment, SamplingParams())
    assert buyer.end_reason == "answer" and buyer.environment_reward == 1.0
    for browser in browsers:
        assert browser.end_reason == "max_turns", browser.error  # the agent's 8 turns
        assert len(browser.turns) == 8 and browser.environment_reward is None
    for trajectory in (buyer, *browsers):
        for s in trajectory.sequences:
            pages = [t for t, m in zip(s.response_ids, s.loss_mask, strict=True) if not m]
            assert "Invalid action" not in llm.tokenizer.decode(pages)
