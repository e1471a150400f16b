"""Our agents, rewards, data and retriever inside veRL (>= 0.9, V1 trainer): multi-context GRPO
with vLLM/SGLang rollouts, sharded training and Ray across nodes (docs/training.md, "Scale out
with veRL").

- :class:`MemSearcherAgentLoop` (``agent_loop.py``): the agent loop veRL builds from
  ``configs/verl/agent_loop.yaml``; needs ``pip install 'memsearcher[verl]'``;
- ``python -m memsearcher.integrations.verl.main``: veRL's ``main_ppo`` behind our checks;
- ``memsearcher verl prepare``: FlashRAG questions to veRL's parquet (``data.py``);
- :func:`check_trainer_config`: the veRL settings under which the loop trains correctly.

Only ``agent_loop.py`` and ``main.py`` import veRL, so the rest works without it.
"""

from __future__ import annotations

from typing import Any

from memsearcher.integrations.verl.checks import SUPPORTED_ESTIMATORS, check_trainer_config
from memsearcher.integrations.verl.data import example_from_row, verl_rows, write_parquet
from memsearcher.integrations.verl.outputs import turn_rows

__all__ = [
    "SUPPORTED_ESTIMATORS",
    "MemSearcherAgentLoop",
    "check_trainer_config",
    "example_from_row",
    "turn_rows",
    "verl_rows",
    "write_parquet",
]


def __getattr__(name: str) -> Any:
    if name == "MemSearcherAgentLoop":
        try:
            from memsearcher.integrations.verl.agent_loop import MemSearcherAgentLoop
        except ImportError as error:
            from memsearcher.errors import MemSearcherError

            raise MemSearcherError(
                f"the veRL agent loop needs veRL ({error}): pip install 'memsearcher[verl]'"
            ) from None
        return MemSearcherAgentLoop
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
