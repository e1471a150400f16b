"""The veRL settings under which our one-output-per-turn loop trains correctly, and why.

The loop returns one ``AgentLoopOutput`` per turn sequence of a trajectory (a MemSearcher
trajectory of N turns is N rows). veRL 0.9's V1 trainer handles that only on one path:
``verl/trainer/ppo/v1/utils.py::compute_advantage_for_multi_trajectories`` with
``algorithm.adv_estimator=grpo`` scores each trajectory once, from its final row, normalizes
within the question's group, and gives that advantage to every row of the trajectory: our
multi-context GRPO. Everything else would train on wrong advantages without any error, so the
loop and ``python -m memsearcher.integrations.verl.main`` refuse to start instead.

The loop also ends each action at a stop string, which the rollout server matches in decoded
text. veRL 0.9.1's vLLM server always loads its tokenizer; its SGLang and TensorRT-LLM servers
pass on ``rollout.skip_tokenizer_init`` (default true: token ids only), and SGLang without a
tokenizer cannot match a stop string, so they need ``skip_tokenizer_init=false``.
"""

from __future__ import annotations

from typing import Any

from memsearcher.errors import MemSearcherError

__all__ = ["SUPPORTED_ESTIMATORS", "check_trainer_config"]

SUPPORTED_ESTIMATORS = ("grpo",)
"""``algorithm.adv_estimator`` values that take veRL's multi-trajectory GRPO path."""


def _get(config: Any, dotted: str, default: Any = None) -> Any:
    """``config.a.b.c`` on a DictConfig or nested dicts, ``default`` where a level is absent."""
    node = config
    for key in dotted.split("."):
        if node is None:
            return default
        getter = getattr(node, "get", None)
        node = getter(key, None) if getter is not None else getattr(node, key, None)
    return default if node is None else node


def check_trainer_config(config: Any) -> None:
    """Raise :class:`MemSearcherError` naming every veRL setting that would mistrain our loop."""
    problems: list[str] = []
    estimator = str(_get(config, "algorithm.adv_estimator", "gae"))
    estimator = estimator.split(".")[-1].lower()  # "AdvantageEstimator.GRPO" -> "grpo"
    if estimator not in SUPPORTED_ESTIMATORS:
        problems.append(
            f"algorithm.adv_estimator={estimator}: only {', '.join(SUPPORTED_ESTIMATORS)} is "
            "supported. The memsearcher agent loop returns one row per turn, and veRL computes "
            "per-trajectory advantages (compute_advantage_for_multi_trajectories: score the final "
            "row, broadcast to the trajectory's rows) only for 'grpo'; any other estimator treats "
            "every turn row as an independent sample, so a trajectory of N turns counts N times "
            "in its group's mean and std, and each turn gets its own advantage. "
            "Set algorithm.adv_estimator=grpo."
        )
    if not bool(_get(config, "trainer.use_v1", False)):
        problems.append(
            "trainer.use_v1=false: veRL's legacy trainer expects one output per trajectory and "
            "breaks on the list of per-turn outputs this loop returns. Set trainer.use_v1=true."
        )
    if bool(_get(config, "algorithm.use_kl_in_reward", False)):
        problems.append(
            "algorithm.use_kl_in_reward=true: veRL's GRPO scores a trajectory from its final row "
            "only, so the KL penalty of every earlier turn would be dropped from the reward. Use "
            "the KL loss instead (actor_rollout_ref.actor.use_kl_loss=true, kl_loss_type="
            "low_var_kl, as the paper does)."
        )
    rollout = str(_get(config, "actor_rollout_ref.rollout.name", "vllm"))
    if rollout != "vllm" and bool(
        _get(config, "actor_rollout_ref.rollout.skip_tokenizer_init", True)
    ):
        problems.append(
            f"actor_rollout_ref.rollout.name={rollout} with skip_tokenizer_init=true: veRL 0.9.1 "
            "then starts the rollout server without a tokenizer (vLLM's server always loads one), "
            "and SGLang cannot match stop strings without a tokenizer, so our agents' stops "
            "(</tool_call>, </memory>, </search>) would not end a generation. Set "
            "actor_rollout_ref.rollout.skip_tokenizer_init=false."
        )
    if problems:
        raise MemSearcherError(
            "this veRL configuration would mistrain the memsearcher agent loop:\n- "
            + "\n- ".join(problems)
        )
