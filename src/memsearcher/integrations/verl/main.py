"""``python -m memsearcher.integrations.verl.main [hydra overrides]``: veRL's PPO entry point
(``verl.trainer.main_ppo``, same config, same overrides), with our checks run first.

``python -m verl.trainer.main_ppo`` runs our agent loop too, but it can only refuse a wrong
setting once the loop is built, after Ray has started and the models have loaded, and veRL logs
an agent loop's error per sample instead of stopping. This entry point refuses before anything
starts (``checks.check_trainer_config``) and then hands the same config to veRL's ``main``.
"""

from __future__ import annotations

import sys
from typing import Any

import hydra

from memsearcher.errors import MemSearcherError
from memsearcher.integrations.verl.checks import check_trainer_config


def _check_agent_loop(config: Any) -> None:
    if not config.actor_rollout_ref.rollout.agent.get("agent_loop_config_path"):
        raise MemSearcherError(
            "actor_rollout_ref.rollout.agent.agent_loop_config_path is not set: point it at "
            "configs/verl/agent_loop.yaml (or your copy) so that veRL can build our agent loop"
        )


@hydra.main(config_path="pkg://verl.trainer.config", config_name="ppo_trainer", version_base=None)
def main(config: Any) -> None:
    try:
        check_trainer_config(config)
        _check_agent_loop(config)
    except MemSearcherError as error:
        print(f"memsearcher: error: {error}", file=sys.stderr)
        sys.exit(2)
    from verl.trainer.main_ppo import main as verl_main

    verl_main(config)  # hydra passes a given config straight to the task function


if __name__ == "__main__":
    main()
