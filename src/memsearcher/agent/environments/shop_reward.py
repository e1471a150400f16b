"""WebShop's purchase reward, on the shop's structured products.

WebShop (``web_agent_site/engine/goal.py``, ``get_reward``) scores the product bought against
the instruction's goal::

    r = r_type * (attribute hits + option hits + [price <= limit]) / (|attributes| + |options| + 1)

and ``r_type`` is a ladder over three signals: the product was scraped under the goal's search
query, the two breadcrumbs share at least two departments, and the share of the goal's title
nouns found in the bought title (``title_score``). It is 1 when any signal holds (title score
above 0.2), 0.5 when none does, 0.1 when the title score is under 0.1, and 0 when it is 0.

The formula and the ladder are WebShop's. What differs is the matching, since our products are
structured rather than scraped text:

- attributes match exactly, a goal value against the product's attribute values (WebShop:
  fuzzy ``token_set_ratio > 85``, then a substring test on title, bullet points, description);
- options match exactly by name and value (WebShop: fuzzy on values alone, after normalizing
  colour names);
- the query match is "same category" (our category plays the role of WebShop's scrape query);
- the title score counts the words of the type phrase ("running shoes") instead of the nouns
  spaCy finds in the full titles, so a shared brand word does not count as the same type.
"""

from __future__ import annotations

from collections.abc import Mapping

from memsearcher.agent.environments.shop_world import CATEGORIES, Goal, Product

__all__ = ["shop_reward", "title_score", "type_reward"]


def title_score(bought_kind: str, goal_kind: str) -> float:
    """Share of the goal type's words that the bought product's type also has."""
    goal_words = set(goal_kind.split())
    return len(goal_words & set(bought_kind.split())) / len(goal_words)


def type_reward(query_match: bool, category_match: bool, title: float) -> float:
    """WebShop's ``get_type_reward`` ladder, given its three signals."""
    reward = 1.0 if query_match or category_match or title > 0.2 else 0.5
    if title < 0.1:
        reward = 0.1
    if title == 0.0:
        reward = 0.0
    return reward


def shop_reward(
    product: Product, options: Mapping[str, str], goal: Goal
) -> tuple[float, dict[str, float]]:
    """Reward of buying ``product`` with the chosen ``options`` (name -> value), and its parts."""
    goal_category = CATEGORIES[goal.category]
    query_match = product.category == goal.category
    category_match = len(set(product.breadcrumb) & set(goal_category.breadcrumb)) >= 2
    title = title_score(product.kind, goal_category.kind)
    r_type = type_reward(query_match, category_match, title)

    bought = set(product.attributes.values())
    attribute_hits = sum(value in bought for value in goal.attributes)
    option_hits = sum(options.get(name) == value for name, value in goal.options.items())
    price_ok = product.price <= goal.price_upper
    total = len(goal.attributes) + len(goal.options) + 1
    reward = r_type * (attribute_hits + option_hits + price_ok) / total
    parts = {
        "r_type": r_type,
        "title_score": title,
        "query_match": float(query_match),
        "category_match": float(category_match),
        "r_attr": attribute_hits / len(goal.attributes),
        "r_option": option_hits / len(goal.options) if goal.options else 1.0,
        "r_price": float(price_ok),
    }
    return reward, parts
