"""The offline shop: a seeded catalogue, WebShop's reward by hand, its text pages and actions.

Everything here is real: the generated catalogue, the project's BM25 index over it (built in a
temporary folder), the environment and its oracle. Nothing is mocked.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memsearcher.agent.environments.shop import (
    SEP,
    ShopEnv,
    ShopSearch,
    parse_action,
    solve,
)
from memsearcher.agent.environments.shop_reward import shop_reward, title_score, type_reward
from memsearcher.agent.environments.shop_world import (
    CATEGORIES,
    SPLITS,
    Catalogue,
    Goal,
    Product,
    ShopConfig,
    deal_ids,
    generate_catalogue,
)
from memsearcher.errors import MemSearcherError


@pytest.fixture(scope="module")
def catalogue() -> Catalogue:
    return generate_catalogue(ShopConfig(seed=0))


@pytest.fixture(scope="module")
def search(catalogue: Catalogue) -> ShopSearch:
    return ShopSearch(catalogue.products)


def env_for(catalogue: Catalogue, search: ShopSearch, index: int = 0, **kw: int) -> ShopEnv:
    env = ShopEnv(catalogue, search, catalogue.split("test")[index], **kw)
    env.reset()
    return env


def goal_query(goal: Goal) -> str:
    return " ".join([*goal.attributes, CATEGORIES[goal.category].kind])


# --- the catalogue -------------------------------------------------------------------------


def test_catalogue_is_the_same_for_a_seed_and_differs_for_another() -> None:
    first, again = generate_catalogue(ShopConfig(seed=3)), generate_catalogue(ShopConfig(seed=3))
    other = generate_catalogue(ShopConfig(seed=4))
    assert first == again
    assert first.products != other.products
    assert [i.text for i in first.instructions] != [i.text for i in other.instructions]


def test_splits_are_disjoint_by_target_product(catalogue: Catalogue) -> None:
    targets = {name: {i.goal.asin for i in catalogue.split(name)} for name in SPLITS}
    assert all(targets.values()), {name: len(t) for name, t in targets.items()}
    assert not targets["train"] & targets["rl"]
    assert not targets["train"] & targets["test"]
    assert not targets["rl"] & targets["test"]
    assert sum(len(catalogue.split(name)) for name in SPLITS) == len(catalogue.instructions)


def test_deal_ids_puts_another_shop_under_these_ids() -> None:
    tested = generate_catalogue(ShopConfig(seed=0, families_per_category=2))
    other = generate_catalogue(ShopConfig(seed=1001, families_per_category=2))
    ids = [p.asin for p in tested.products]
    dealt = deal_ids(other, ids, seed=0)
    assert sorted(p.asin for p in dealt.products) == sorted(ids)
    assert deal_ids(other, ids, seed=0) == dealt  # the same deal for a seed
    titles = {p.asin: p.title for p in tested.products}
    # other products under the same ids: an id learnt in SFT answers nothing in the tested shop
    assert all(titles[p.asin] != p.title for p in dealt.products)
    for old, new in zip(other.instructions, dealt.instructions, strict=True):
        assert new.text == old.text  # instructions never name an id
        target = dealt.product(new.goal.asin)
        assert target.title == other.product(old.goal.asin).title


def test_every_target_has_its_distractors(catalogue: Catalogue) -> None:
    """A near-duplicate per attribute (same brand, one attribute changed), and a copy over
    the price limit; so neither the first result nor the first title match is safe to buy."""
    for instruction in catalogue.instructions:
        goal = instruction.goal
        target = catalogue.product(goal.asin)
        assert target.price <= goal.price_upper
        same_brand = [
            p for p in catalogue.products if p.brand == target.brand and p.asin != target.asin
        ]
        differing = [
            sum(a != b for a, b in zip(p.attributes.values(), goal.attributes, strict=True))
            for p in same_brand
        ]
        assert differing.count(1) >= len(goal.attributes)
        copies = [p for p, d in zip(same_brand, differing, strict=True) if d == 0]
        assert any(p.price > goal.price_upper and p.title == target.title for p in copies)


def test_instruction_text_is_webshops_template(catalogue: Catalogue) -> None:
    for instruction in catalogue.instructions:
        goal, text = instruction.goal, instruction.text
        assert text.startswith("i need ")
        assert text.endswith(f", and price lower than {goal.price_upper:.2f} dollars")
        assert all(value in text for value in goal.attributes)
        options = ", and ".join(f"{name}: {value}" for name, value in goal.options.items())
        assert f"with {options}," in text
        # goal.py draws the limit among the first four multiples of 10 above the price
        price = catalogue.product(goal.asin).price
        assert goal.price_upper % 10 == 0 and price + 10 < goal.price_upper <= price + 40


# --- the reward, worked by hand ------------------------------------------------------------

TEE = Product(
    "B0TEST0001", "t-shirt", "Kalo", "Kalo Crew Neck Cotton T-shirt, Quick dry",
    {"style": "crew neck", "material": "cotton", "feature": "quick dry"},
    {"size": ("s", "m", "l"), "color": ("navy", "black")},
    24.99,
)  # fmt: skip
GOAL = Goal(
    "B0TEST0001", "t-shirt", ("crew neck", "cotton", "quick dry"),
    {"size": "m", "color": "navy"}, 30.0,
)  # fmt: skip
RIGHT = {"size": "m", "color": "navy"}


@pytest.mark.parametrize(
    ("case", "product", "options", "expected"),
    [
        # 3 attributes + 2 options + 1 price term = 6 in the denominator; r_type = 1 (same type)
        ("all right: (3 + 2 + 1) / 6", TEE, RIGHT, 1.0),
        ("wrong size: (3 + 1 + 1) / 6", TEE, {"size": "s", "color": "navy"}, 5 / 6),
        (
            "polyester, not cotton: (2 + 2 + 1) / 6",
            replace(TEE, attributes={**TEE.attributes, "material": "polyester"}),
            RIGHT,
            5 / 6,
        ),
        ("$34.99 over the $30 limit: (3 + 2 + 0) / 6", replace(TEE, price=34.99), RIGHT, 5 / 6),
        (
            "no option clicked, wrong style, over price: (2 + 0 + 0) / 6",
            replace(TEE, attributes={**TEE.attributes, "style": "v-neck"}, price=31.0),
            {},
            1 / 3,
        ),
        (
            # a hoodie shares two departments (clothing, men): category match, yet the type
            # words share nothing, title score 0, and WebShop's ladder ends at r_type = 0
            "a cotton hoodie with every other term right: 0 * 6 / 6",
            replace(TEE, category="hoodie"),
            RIGHT,
            0.0,
        ),
    ],
)
def test_reward_by_hand(
    case: str, product: Product, options: dict[str, str], expected: float
) -> None:
    reward, _ = shop_reward(product, options, GOAL)
    assert reward == pytest.approx(expected), case


def test_reward_parts_of_a_wrong_type() -> None:
    _, parts = shop_reward(replace(TEE, category="hoodie"), RIGHT, GOAL)
    assert parts["query_match"] == 0.0 and parts["category_match"] == 1.0
    assert parts["title_score"] == 0.0 and parts["r_type"] == 0.0
    assert parts["r_attr"] == 1.0 and parts["r_option"] == 1.0 and parts["r_price"] == 1.0


def test_type_ladder_as_webshop_writes_it() -> None:
    assert type_reward(query_match=False, category_match=False, title=0.5) == 1.0
    assert type_reward(query_match=True, category_match=False, title=0.15) == 1.0
    assert type_reward(query_match=False, category_match=False, title=0.15) == 0.5
    assert type_reward(query_match=True, category_match=True, title=0.05) == 0.1
    assert type_reward(query_match=True, category_match=True, title=0.0) == 0.0
    assert title_score("running shoes", "trail running shoes") == pytest.approx(2 / 3)
    assert title_score("desk lamp", "coffee mug") == 0.0


# --- the environment -----------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_every_test_instruction_is_solved_by_the_oracle(seed: int) -> None:
    catalogue = generate_catalogue(ShopConfig(seed=seed))
    search = ShopSearch(catalogue.products)
    for instruction in catalogue.split("test"):
        actions = solve(ShopEnv(catalogue, search, instruction))
        # replay on a fresh episode: the actions alone, not the oracle's env, earn the reward
        env = ShopEnv(catalogue, search, instruction)
        env.reset()
        for action in actions:
            _, reward, done, info = env.step(action)
            assert info["valid"], (action, instruction.text)
        assert done and reward == 1.0, (instruction.text, actions, info)
        assert info["bought"] == instruction.goal.asin


def test_distractors_make_the_top_result_unsafe(catalogue: Catalogue, search: ShopSearch) -> None:
    """Searching the instruction itself lists the target on page 1, but buying the top result
    with the right options succeeds on fewer than 60% of test instructions: the over-priced
    copy has the same title, and near-duplicates share all but one word of it."""
    test = catalogue.split("test")
    rewards = []
    for instruction in test:
        results = search.search(instruction.text)
        assert instruction.goal.asin in results[:10]
        env = ShopEnv(catalogue, search, instruction)
        env.reset()
        env.step(f"search[{instruction.text}]")
        env.step(f"click[{results[0]}]")
        for value in instruction.goal.options.values():
            env.step(f"click[{value}]")
        rewards.append(env.step("click[Buy Now]")[1])
    assert sum(r == 1.0 for r in rewards) < 0.6 * len(test)
    assert all(r > 0 for r in rewards)  # the right type and attributes, at least partly


def test_buying_the_over_priced_copy_loses_the_price_term(
    catalogue: Catalogue, search: ShopSearch
) -> None:
    env = env_for(catalogue, search)
    target = catalogue.product(env.goal.asin)
    copy = next(
        p for p in catalogue.products
        if p.title == target.title and p.price > env.goal.price_upper
    )  # fmt: skip
    env.step(f"search[{copy.title}]")
    env.step(f"click[{copy.asin}]")
    for value in env.goal.options.values():
        env.step(f"click[{value}]")
    _, reward, done, info = env.step("click[Buy Now]")
    n = len(env.goal.attributes) + len(env.goal.options)
    assert done and info["r_price"] == 0.0 and reward == pytest.approx(n / (n + 1))


def test_search_page_text(catalogue: Catalogue, search: ShopSearch) -> None:
    env = env_for(catalogue, search)
    assert (
        env.observation() == f"WebShop [SEP] Instruction: [SEP] {env.instruction.text} [SEP] Search"
    )
    assert env.available_actions() == {"has_search_bar": True, "clickables": []}


def test_results_pages_text_and_paging(catalogue: Catalogue, search: ShopSearch) -> None:
    env = env_for(catalogue, search)
    page, reward, done, info = env.step("search[cotton]")
    asins = search.search("cotton")
    assert len(asins) > 10 and reward == 0.0 and not done and info["valid"]
    head = f"Instruction: [SEP] {env.instruction.text} [SEP] Back to Search"
    listed = []
    for p in (catalogue.product(a) for a in asins[:10]):
        listed += [p.asin, p.title, f"${p.price:.2f}"]
    assert page == SEP.join([head, f"Page 1 (Total results: {len(asins)})", "Next >", *listed])
    clickables = env.available_actions()["clickables"]
    assert clickables == ["back to search", "next >", *(a.lower() for a in asins[:10])]

    page, *_ = env.step("click[Next >]")
    assert page.startswith(f"{head} [SEP] Page 2 (Total results: {len(asins)}) [SEP] < Prev")
    assert asins[10] in page and asins[0] not in page
    while "next >" in env.available_actions()["clickables"]:
        env.step("click[next >]")
    assert asins[-1] in env.observation() and "Next >" not in env.observation()
    env.step("click[< Prev]")
    env.step("click[back to search]")
    assert env.observation().startswith("WebShop [SEP] ")


def test_item_page_text_and_options(catalogue: Catalogue, search: ShopSearch) -> None:
    env = env_for(catalogue, search)
    product = catalogue.product(env.goal.asin)
    env.step(f"search[{goal_query(env.goal)}]")
    page, *_ = env.step(f"click[{product.asin.lower()}]")
    options = [text for name, values in product.options.items() for text in (name, *values)]
    expected = [
        "Instruction:", env.instruction.text, "Back to Search", "< Prev", *options,
        product.title, f"Price: ${product.price:.2f}", "Buy Now",
    ]  # fmt: skip
    assert page == SEP.join(expected)
    values = [v for vs in product.options.values() for v in vs]
    assert env.available_actions() == {
        "has_search_bar": False,
        "clickables": ["back to search", "< prev", *values, "buy now"],
    }
    # a later click of the same option name replaces the earlier one
    size_name, (first, second, *_) = next(iter(product.options.items()))
    env.step(f"click[{first}]")
    env.step(f"click[{second}]")
    assert env.state.options == {size_name: second}
    env.step("click[< Prev]")
    assert env.state.page == "results" and env.state.options == {}


@pytest.mark.parametrize(
    ("setup", "action", "why"),
    [
        ([], "buy the shirt", "write search[keywords] or click"),
        ([], "jump[results]", "write search[keywords] or click"),
        ([], "search[   ]", "needs keywords"),
        ([], "click[buy now]", "not a clickable on this page"),
        (["search[cotton]"], "search[linen]", "search is only on the search page"),
        (["search[cotton]"], "click[B0NOTHERE0]", "not a clickable on this page"),
        (["search[cotton]"], "click[< prev]", "not a clickable on this page"),
        (["search[cotton]"], "click[buy now]", "not a clickable on this page"),
    ],
)
def test_invalid_actions_say_so_and_change_nothing(
    catalogue: Catalogue, search: ShopSearch, setup: list[str], action: str, why: str
) -> None:
    env = env_for(catalogue, search)
    for step in setup:
        env.step(step)
    before = env.observation()
    page, reward, done, info = env.step(action)
    assert page.startswith("Invalid action: ") and why in page
    assert page.endswith(f"[SEP] {before}") and env.observation() == before
    assert reward == 0.0 and not done and info["valid"] is False


def test_an_option_of_another_product_is_not_clickable(
    catalogue: Catalogue, search: ShopSearch
) -> None:
    env = env_for(catalogue, search)
    product = catalogue.product(env.goal.asin)
    env.step(f"search[{goal_query(env.goal)}]")
    env.step(f"click[{product.asin}]")
    missing = next(
        v
        for v in CATEGORIES[product.category].options["color"]
        if v not in product.options["color"]
    )
    page, _, _, info = env.step(f"click[{missing}]")
    assert not info["valid"] and env.state.options == {}


def test_step_limit_ends_with_reward_zero(catalogue: Catalogue, search: ShopSearch) -> None:
    actions = solve(env_for(catalogue, search))
    env = env_for(catalogue, search, max_steps=len(actions))
    for action in actions:
        _, reward, done, info = env.step(action)
    assert done and reward == 1.0 and "truncated" not in info

    env = env_for(catalogue, search, max_steps=len(actions) - 1)
    for action in actions[:-1]:
        _, reward, done, info = env.step(action)
    assert done and reward == 0.0 and info["truncated"] is True
    page, reward, done, info = env.step(actions[-1])
    assert page.startswith("Invalid action: the episode is over") and reward == 0.0 and done


def test_repeat_ends_stops_an_invalid_action_written_twice_in_a_row(
    catalogue: Catalogue, search: ShopSearch
) -> None:
    """Only with ``repeat_ends``, and only the same invalid action right after itself: the
    fixed point a memory agent's greedy decoding stays in, as its prompt does not change."""
    bad, other = "click[B0NOTHERE0]", "click[< prev]"
    env = env_for(catalogue, search)
    env.step("search[cotton]")
    for _ in range(3):
        _, reward, done, info = env.step(bad)
        assert not done and not info["valid"] and "repeated" not in info
    env = ShopEnv(catalogue, search, catalogue.split("test")[0], repeat_ends=True)
    env.reset()
    env.step("search[cotton]")
    for action in (bad, other, bad, "click[next >]", bad):  # never twice in a row
        _, _, done, _ = env.step(action)
        assert not done
    page, reward, done, info = env.step(bad)
    assert done and reward == 0.0 and info == {"valid": False, "repeated": True}
    assert page.startswith("Invalid action: ")
    env.reset()
    env.step(bad)
    assert not env.done, "reset forgets the last invalid action"


def test_reset_starts_a_fresh_episode(catalogue: Catalogue, search: ShopSearch) -> None:
    env = env_for(catalogue, search)
    start = env.observation()
    solve(env)
    assert env.done
    assert env.reset() == start and not env.done and env.steps == 0


def test_parse_action() -> None:
    assert parse_action("search[ Navy Cotton T-Shirt ]") == ("search", "navy cotton t-shirt")
    assert parse_action("click[Buy Now]") == ("click", "buy now")
    assert parse_action("  Click[< Prev]\n") == ("click", "< prev")
    assert parse_action("click[]") == ("click", "")
    assert parse_action("buy now") is None
    assert parse_action("open[B0ABC]") is None
    assert parse_action("click[a] and more") is None


@settings(max_examples=200, deadline=None)
@given(
    actions=st.lists(st.text(max_size=30) | st.sampled_from(["search[cotton]", "click[next >]"]))
)
def test_any_actions_never_crash(
    catalogue: Catalogue, search: ShopSearch, actions: list[str]
) -> None:
    """Arbitrary model output is an invalid step, never an exception."""
    env = env_for(catalogue, search)
    for action in actions:
        page, reward, done, info = env.step(action)
        assert isinstance(page, str) and reward == 0.0
        assert re.match(r"(Invalid action: |WebShop|Instruction:)", page)


def test_instructions_of_one_target_choose_different_options(catalogue: Catalogue) -> None:
    chosen: dict[str, list[dict[str, str]]] = {}
    for instruction in catalogue.instructions:
        chosen.setdefault(instruction.goal.asin, []).append(instruction.goal.options)
    for options in chosen.values():
        assert len(options) == catalogue.config.instructions_per_product
        assert len({tuple(o.items()) for o in options}) == len(options)


@pytest.mark.parametrize(
    ("field", "value"),
    [("options_offered", 4), ("options_offered", 0), ("test_fraction", 0.9), ("rl_fraction", -0.1)],
)
def test_bad_config_names_its_key(field: str, value: float) -> None:
    with pytest.raises(MemSearcherError, match=f"shop.{field}"):
        ShopConfig(**{field: value})
