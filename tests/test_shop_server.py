"""The shop over WebShop's HTTP protocol: the real server in a subprocess on 127.0.0.1, and
``WebShopHTTPEnv`` acting on it.

The oracle's actions (from ``solve`` on a local ``ShopEnv``) are replayed over HTTP and must
buy the right thing; random walks must see the same text, clickables, rewards and refusals over
HTTP as in ``ShopEnv``; bad sessions, actions and URLs get clear answers. princeton-nlp's own
server cannot run here (no internet, no product data): ``read_page`` is checked on a page
written after its templates instead.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from _servers import free_port, shop_server
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from memsearcher.agent.environments.shop import SEP, ShopEnv, ShopSearch, solve
from memsearcher.agent.environments.shop_world import Catalogue, ShopConfig, generate_catalogue
from memsearcher.agent.environments.webshop_client import (
    WebShopHTTPEnv,
    episode_session,
    read_page,
)
from memsearcher.errors import MemSearcherError

SEED, FAMILIES = 0, 2
"""The catalogue the server serves: small, so a test instruction's episode is quick."""


@pytest.fixture(scope="module")
def catalogue() -> Catalogue:
    return generate_catalogue(ShopConfig(seed=SEED, families_per_category=FAMILIES))


@pytest.fixture(scope="module")
def search(catalogue: Catalogue) -> ShopSearch:
    return ShopSearch(catalogue.products)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with shop_server(SEED, FAMILIES, "test", tmp_path_factory.mktemp("log") / "shop.log") as url:
        yield url


def local(catalogue: Catalogue, search: ShopSearch, index: int) -> ShopEnv:
    return ShopEnv(catalogue, search, catalogue.split("test")[index])


def test_the_oracle_buys_the_target_over_http(
    server: str, catalogue: Catalogue, search: ShopSearch
) -> None:
    """Every test instruction: the oracle's actions, replayed over HTTP, earn reward 1."""
    tests = catalogue.split("test")
    assert len(tests) >= 4
    for index in range(len(tests)):
        actions = solve(local(catalogue, search, index))
        remote = WebShopHTTPEnv(server, index)
        remote.reset()
        assert remote.instruction_text == tests[index].text
        for action in actions[:-1]:
            _, reward, done, info = remote.step(action)
            assert info["valid"] and not done and reward == 0.0, (index, action)
        _, reward, done, info = remote.step(actions[-1])
        assert (reward, done) == (1.0, True), (index, actions)
        assert info["bought"] == tests[index].goal.asin
        assert info["options"] == tests[index].goal.options
        remote.close()


def walk(rng: random.Random, available: dict[str, Any], goal_words: list[str]) -> str:
    """A random action: mostly a clickable (Next > more often, to reach later pages), sometimes
    a search (allowed or not; the whole instruction as the query fills several pages),
    sometimes nonsense."""
    roll = rng.random()
    clickables = list(available["clickables"])
    if roll < 0.08:
        return rng.choice(["click[nothing here]", "jump[3]", "search[]", "click[]", "buy"])
    if available["has_search_bar"] or roll < 0.15 or not clickables:
        words = goal_words if rng.random() < 0.5 else rng.sample(goal_words, k=3)
        return f"search[{' '.join(words)}]"
    if "next >" in clickables and roll < 0.5:
        return "click[next >]"
    return f"click[{rng.choice(clickables)}]"


def test_pages_over_http_equal_shopenv_step_for_step(
    server: str, catalogue: Catalogue, search: ShopSearch
) -> None:
    """Random walks, mixed with the oracle, on every test instruction: the same text, the
    same clickables, the same rewards and refusals, except the page after Buy Now (the done
    page over HTTP, the item page in ShopEnv: documented)."""
    rng = random.Random(0)
    covered: set[str] = set()
    for index, instruction in enumerate(catalogue.split("test")):
        words = instruction.text.replace(",", "").split()
        for walk_number in range(3):
            env, remote = local(catalogue, search, index), WebShopHTTPEnv(server, index)
            assert remote.reset() == env.reset()
            # the oracle; a tour of the result pages (Next > where there is one) and a query with
            # characters a URL must escape; chance
            tour = [f"search[{' '.join(words)}]", "click[next >]", "click[< prev]"]
            tour += ["click[back to search]", f"search[{'/'.join(words[3:6])}?#%]"]
            script = [solve(local(catalogue, search, index)), tour, []][walk_number]
            for step in range(env.max_steps + 1):
                assert remote.available_actions() == env.available_actions()
                action = (
                    script[step]
                    if step < len(script)
                    else walk(rng, env.available_actions(), words)
                )
                seen, reward, done, info = env.step(action)
                got, remote_reward, remote_done, remote_info = remote.step(action)
                assert (remote_reward, remote_done) == (reward, done), (index, action)
                assert remote_info["valid"] == info["valid"]
                assert remote_info.get("bought") == info.get("bought")
                covered.add(what(action, info, reward, env))
                if "bought" not in info:
                    assert got == seen, (index, step, action)
                else:
                    assert got.startswith("Thank you for shopping with us!")
                    assert f"Your score (min 0.0, max 1.0){SEP}{reward}" in got
                if done:
                    break
            remote.close()
    # the walks went everywhere: paging both ways, products, options, refusals, bad buys
    assert covered >= {
        "search", "next >", "< prev", "back to search", "product", "option", "refused",
        "bought 1.0", "bought partly", "truncated",
    }, covered  # fmt: skip


def what(action: str, info: dict[str, object], reward: float, env: ShopEnv) -> str:
    """What kind of step ``action`` was, for the coverage check."""
    if not info["valid"]:
        return "refused"
    if "bought" in info:
        return "bought 1.0" if reward == 1.0 else "bought partly"
    if info.get("truncated"):
        return "truncated"
    kind, argument = action[:-1].split("[", 1)
    if kind == "search" or argument in ("next >", "< prev", "back to search"):
        return kind if kind == "search" else argument
    return "product" if argument.upper() in env.products else "option"


def test_an_episode_session_of_its_own_shops_for_the_same_goal(
    server: str, catalogue: Catalogue
) -> None:
    """WebShop's rule, which `WebShopEnvironment` relies on to keep a group's episodes apart:
    any id with ``fixed`` in it names the goal after its last ``_``."""
    tests = catalogue.split("test")
    sessions = {episode_session("fixed_2") for _ in range(3)}
    assert len(sessions) == 3 and all(s.startswith("fixed-") for s in sessions)
    for session in sessions:
        remote = WebShopHTTPEnv(server, session)
        remote.reset()
        assert remote.instruction_text == tests[2].text
    assert episode_session("abc") == "abc"  # not a fixed goal: as it is


def test_bad_sessions_raise_a_clear_error(server: str, catalogue: Catalogue) -> None:
    last = len(catalogue.split("test")) - 1
    for session in ("nobody", f"fixed_{last + 1}", "fixed_-1", "fixed_0/../x"):
        with pytest.raises(MemSearcherError, match=r"404|unknown session|not a WebShop"):
            WebShopHTTPEnv(server, session).reset()
    with pytest.raises(MemSearcherError, match=f"fixed_0 .. fixed_{last}"):
        WebShopHTTPEnv(server, "nobody").reset()
    with pytest.raises(MemSearcherError, match="cannot reach"):
        WebShopHTTPEnv(f"http://127.0.0.1:{free_port()}", 0).reset()


def test_bad_actions_show_the_page_again(server: str) -> None:
    with WebShopHTTPEnv(server, 0, max_steps=6) as remote:
        check_refusals(remote)


def check_refusals(remote: WebShopHTTPEnv) -> None:
    start = remote.reset()
    for action in ("click[buy now]", "jump[x]", "search[]"):
        observation, reward, done, info = remote.step(action)
        assert observation.startswith("Invalid action: ") and observation.endswith(start)
        assert (reward, done, info["valid"]) == (0.0, False, False)
    remote.step("search[cotton t-shirt]")
    observation, _, _, info = remote.step("search[hoodie]")
    assert "search is only on the search page" in observation and not info["valid"]
    _, _, done, info = remote.step("click[back to search]")
    assert done and info["truncated"]
    observation, _, done, info = remote.step("click[back to search]")
    assert "the episode is over" in observation and done and not info["valid"]


def test_a_page_the_server_refuses_is_an_invalid_step(server: str) -> None:
    """A clickable whose URL the server answers with an error (here: a product link edited to
    an id the shop lacks) shows the page again with the server's reason."""
    remote = WebShopHTTPEnv(server, 0)
    remote.reset()
    results = remote.step("search[cotton t-shirt]")[0]
    first = remote.available_actions()["clickables"][2]
    link = remote.page.clickables[first]
    remote.page.clickables[first] = type(link)("GET", link.url.replace(first.upper(), "B0NOTHERE"))
    observation, reward, done, info = remote.step(f"click[{first}]")
    assert not info["valid"] and not done and reward == 0.0
    assert "the server answered 404: no product 'B0NOTHERE'" in observation
    assert observation.endswith(results)


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/search_results/fixed_0/%5B1%5D/1", 422),  # keywords not strings
        ("/search_results/fixed_0/%5B%27a%27/1", 422),  # not a literal
        ("/search_results/fixed_0/%5B%28%27a%27%2C%29%5D/1", 422),  # [('a',)]
        ("/item_page/fixed_0/B0SSIHY3PJ/cotton/1/%7B1%3A%20%27m%27%7D", 422),  # {1: 'm'}
        ("/search_results/fixed_0/cotton/0", 422),  # no page 0
        ("/item_page/fixed_0/B0NOTHERE/cotton/1/%7B%7D", 404),
        ("/done/fixed_0/B0NOTHERE/%7B%7D", 404),
        ("/search_results/nobody/cotton/1", 404),
        ("/search_results/fixed_0/" + "%5B" * 3000 + "/1", 422),  # deep nesting, too long
        ("/no/such/route", 404),
    ],
)
def test_bad_urls_get_a_4xx_reason(server: str, path: str, status: int) -> None:
    response = httpx.get(server + path, timeout=30)
    assert response.status_code == status, response.text
    assert response.json()["detail"]
    assert httpx.get(server + "/search_results/fixed_0/cotton/1", timeout=30).status_code == 200


def test_only_loopback_names_reach_it(server: str) -> None:
    response = httpx.get(server + "/fixed_0", headers={"Host": "evil.example"}, timeout=30)
    assert response.status_code == 421


_segment = st.text(st.characters(codec="utf-8", exclude_characters="/?#"), max_size=60)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(keywords=_segment, page=_segment, options=_segment)
@example(keywords="a", page="\u00b9", options="{}")  # "¹".isdigit() holds, int("¹") raises
def test_fuzzed_urls_never_500(server: str, keywords: str, page: str, options: str) -> None:
    keywords, page, options = (quote(s, safe="") for s in (keywords, page, options))
    for path in (
        f"/search_results/fixed_0/{keywords}/{page}",
        f"/item_page/fixed_0/B0X/{keywords}/{page}/{options}",
        f"/done/fixed_0/B0X/{options}",
    ):
        response = httpx.get(server + path, timeout=30)
        assert response.status_code < 500, (path, response.text)


# --- read_page on WebShop's own markup ----------------------------------------------------

# After web_agent_site/templates/results_page.html and item_page.html, with their whitespace,
# the icon inside a button, and the results page's <h4>...</h5> mismatch.
WEBSHOP_RESULTS = """<!DOCTYPE html>
<html>
  <head><title>x</title><script>var a = 1;</script></head>
  <body>
    <div id="instruction-text" class="text-center">
      <h4>Instruction:<br>i need a red shirt</h4>
    </div>
    <form method="post" action="/abc">
      <button type="submit" class="btn btn-success">Back to Search</button>
    </form>
    <h3>Page 1 (Total results: 50)</h3>
    <form method="post" action="/search_results/abc/%5B%27red%27%5D/2">
      <button type="submit" class="btn btn-primary">Next &gt;</button>
    </form>
    <h4 class="mt-0 product-asin"><a class="product-link"
      href="/item_page/abc/B01/%5B%27red%27%5D/1/%7B%7D">B01</a></h5>
    <h4 class="mt-0 product-title">Red Shirt</h5>
    <h5 class="product-price">$10.00</h6>
    <!-- <h5>hidden comment</h5> -->
    <input type="radio" id="radio_size0" name="size" value="M"
      data-url="/item_page/abc/B01/x/1/%7B%27size%27%3A%20%27M%27%7D">
    <label for="radio_size0">M</label>
  </body>
</html>"""


def test_read_page_reads_webshops_markup() -> None:
    page = read_page(WEBSHOP_RESULTS, "http://127.0.0.1:3000/search_results/abc/red/1")
    assert page.texts == [
        "Instruction:", "i need a red shirt", "Back to Search", "Page 1 (Total results: 50)",
        "Next >", "B01", "Red Shirt", "$10.00", "M",
    ]  # fmt: skip
    assert page.instruction == ["Instruction:", "i need a red shirt"]
    assert list(page.clickables) == ["back to search", "next >", "b01", "m"]
    assert page.clickables["back to search"].method == "POST"
    assert page.clickables["back to search"].url == "http://127.0.0.1:3000/abc"
    assert page.clickables["b01"].method == "GET"
    assert page.clickables["m"].url.endswith("/item_page/abc/B01/x/1/%7B%27size%27%3A%20%27M%27%7D")
    assert page.search is None


def test_read_page_reads_webshops_search_and_done_pages() -> None:
    search = read_page(
        '<div id="instruction-text"><h4>Instruction: <br>find x</h4></div>'
        '<form role="form" method="post" action="/abc"><input id="search_input" type="text" '
        'name="search_query" required/><button class="btn btn-success" type="submit">'
        '<i class="glyphicon"></i>Search</button></form>',
        "http://h:3000/abc",
    )
    assert search.search is not None and search.search[0].url == "http://h:3000/abc"
    assert search.search[1] == "search_query" and "search" in search.clickables
    done = read_page(
        '<h1>Thank you</h1><div style="display:none"><h4 id="asin">asin<pre>B01</pre></h4>'
        '<h4 id="options">options<pre>{"size": "M"}</pre></h4></div>'
        '<h3 id="reward">Your score (min 0.0, max 1.0)<pre>0.75</pre></h3>',
        "http://h:3000/done/abc/B01/x",
    )
    assert done.values == {"asin": "B01", "options": '{"size": "M"}', "reward": "0.75"}
    # WebShop's own done page leaves its purchased-asin <h4> open (closed by a stray </p>),
    # and shows the target's asin and goal in <pre>s after it, in the hidden div
    done = read_page(
        '<div style="display:none"><h4 id="asin">asin<pre>B01</pre></p>'
        '<h4 id="options">options<pre>{"size": "M"}</pre></h4>'
        '<h4 id="purchased-query">query<pre>shirt</pre></h4>'
        '<h4 id="goal-asin">asin<pre>B02</pre></p>'
        "<h4>Goal <div id=\"goal\"><pre>{'asin': 'B02'}</pre></div></h4></div>"
        '<h3 id="reward">Your score (min 0.0, max 1.0)<pre>0.5</pre></h3>'
        '<h4 hidden>Reward Details <div id="reward_info"><pre>{}</pre></div></h4>',
        "http://h:3000/done/abc/B01/x",
    )
    assert done.values == {"asin": "B01", "options": '{"size": "M"}', "reward": "0.5"}
