"""Environments: what an agent acts in, behind one protocol (``base``).

- ``search``: search QA over a retriever, the environment every agent has acted in so far.
- ``shop``: an offline shop in the shape of WebShop (Yao et al., 2022), MEM1's second domain. A
  catalogue and its instructions are generated from a seed (``shop_world``); an episode is one
  instruction, acted on with WebShop's ``search[...]`` and ``click[...]`` over its text pages,
  and rewarded at Buy Now by WebShop's formula (``shop_reward``). Import it from
  ``memsearcher.agent.environments.shop``. ``shop_server`` serves it over WebShop's HTTP
  protocol, and ``webshop_client.WebShopHTTPEnv`` acts on such a server (ours or
  princeton-nlp's) with ``ShopEnv``'s API (docs/environments.md).
"""

from __future__ import annotations

from memsearcher.agent.environments.base import (
    Action,
    ActionRefused,
    AsyncEnvironment,
    Environment,
    Observation,
    Page,
    Search,
    ShopAction,
)
from memsearcher.agent.environments.search import (
    BatchedSearch,
    DirectSearch,
    SearchEnvironment,
    as_async_environment,
    as_environment,
)

__all__ = [
    "Action",
    "ActionRefused",
    "AsyncEnvironment",
    "BatchedSearch",
    "DirectSearch",
    "Environment",
    "Observation",
    "Page",
    "Search",
    "SearchEnvironment",
    "ShopAction",
    "as_async_environment",
    "as_environment",
]
