"""The value model of PPO: a separate critic, or a value head on the policy.

- ``critic`` (MEM1's choice, veRL's default): a second copy of the base model with a scalar
  head, ``AutoModelForTokenClassification`` with one label, trained with its own optimizer and
  learning rate (MEM1: 1e-5, ten times the actor's).
- ``head``: one linear layer on the policy's last hidden state, sharing the trunk: half the
  memory, but the value loss then moves the policy's weights too.

Both give the value of the state before each response token, aligned with the targets of a
learner micro-batch (`memsearcher.rl.batching.MicroBatch`) as the log-probs are.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from memsearcher.errors import MemSearcherError
from memsearcher.rl.batching import MicroBatch

__all__ = ["VALUE_MODELS", "Critic", "PolicyValueHead", "ValueModel", "load_critic", "token_values"]


class ValueModel(Protocol):
    """Anything that scores every position of a batch of sequences."""

    def values(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        """(B, L) -> (B, L): the value of the state after each position."""
        ...


class Critic(nn.Module):
    """A separate critic: a causal transformer with a one-output token-classification head."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def values(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        output = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        )
        return output.logits.squeeze(-1).float()  # (B, L)


class PolicyValueHead(nn.Module):
    """A value head on the policy's last hidden state (the trunk is shared)."""

    def __init__(self, policy: Any) -> None:
        """``policy``: a transformers causal LM (it has a ``config.hidden_size``)."""
        super().__init__()
        self.policy = policy
        hidden: int = policy.config.hidden_size
        self.head = nn.Linear(hidden, 1)
        # start at V = 0 everywhere: the first advantages are the returns themselves
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, **inputs: Any) -> tuple[Any, torch.Tensor]:
        """The policy's output and the (B, L) values, from one forward pass."""
        output = self.policy(**inputs, output_hidden_states=True)
        values = self.head(output.hidden_states[-1].to(self.head.weight.dtype)).squeeze(-1)
        return output, values.float()

    def values(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor
    ) -> torch.Tensor:
        _, values = self(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        )
        return values


def load_critic(path: str, device: str = "cpu", dtype: torch.dtype | None = None) -> Critic:
    """A critic initialized from the model at ``path`` (typically the policy's start), with a
    freshly initialized scalar head, as veRL builds MEM1's critic."""
    from transformers import AutoModelForTokenClassification

    try:
        model = AutoModelForTokenClassification.from_pretrained(
            path, num_labels=1, dtype=dtype or torch.float32
        )
    except (OSError, ValueError) as error:
        raise MemSearcherError(f"cannot load a critic from {path}: {error}") from error
    return Critic(model).to(device)


def _head_on(policy: nn.Module) -> PolicyValueHead:
    return PolicyValueHead(policy)


VALUE_MODELS: dict[str, Callable[..., nn.Module]] = {"critic": load_critic, "head": _head_on}
"""``critic`` takes a model path; ``head`` takes the policy module it sits on."""


def token_values(model: ValueModel, batch: MicroBatch) -> torch.Tensor:
    """(B, R): the value before each of the last R tokens of each row (the one the log-prob of
    that token is computed from); 0 where the loss mask is 0. Gradients flow unless called
    under ``torch.no_grad``."""
    device = batch.input_ids.device
    span = batch.targets.shape[1]
    values = model.values(batch.input_ids, batch.attention_mask, batch.position_ids)  # (B, L)
    width = values.shape[1]
    window = values[:, width - span - 1 : width - 1]  # (B, R): position c - 1 predicts c
    return torch.where(batch.loss_mask.to(device).bool(), window, 0.0)
