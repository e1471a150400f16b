"""Environments an agent acts in, beyond search QA.

``shop``: an offline shop in the shape of WebShop (Yao et al., 2022), MEM1's second domain.
A catalogue and its instructions are generated from a seed (``shop_world``); an episode is one
instruction, acted on with WebShop's ``search[...]`` and ``click[...]`` over its text pages, and
rewarded at Buy Now by WebShop's formula (``shop_reward``).
"""

from __future__ import annotations

from memsearcher.envs.shop import ShopEnv, ShopSearch, parse_action, solve
from memsearcher.envs.shop_reward import shop_reward, title_score, type_reward
from memsearcher.envs.shop_world import (
    CATEGORIES,
    SPLITS,
    Catalogue,
    Category,
    Goal,
    Instruction,
    Product,
    ShopConfig,
    generate_catalogue,
)

__all__ = [
    "CATEGORIES",
    "SPLITS",
    "Catalogue",
    "Category",
    "Goal",
    "Instruction",
    "Product",
    "ShopConfig",
    "ShopEnv",
    "ShopSearch",
    "generate_catalogue",
    "parse_action",
    "shop_reward",
    "solve",
    "title_score",
    "type_reward",
]
