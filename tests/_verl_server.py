"""veRL's LLM server client, serving our HF backend on the CPU, and TransferQueue's key-value
calls kept in a dict: the two parts of a veRL run that cannot run here as they are.

- ``HFReplica`` answers what veRL's vLLM replica answers (``vllm_async_server.generate``: token
  ids and a sampling-params dict in, ``TokenOutput`` out, ``max_tokens`` clamped to the
  context, ``stop_reason='completed'``, log-probs on request), generating with our ``HFModel``
  and computing the log-probs with a teacher-forced pass at the sampling temperature (vLLM's
  ``processed_logprobs``). Nothing is canned: every token comes from the real model.
- ``LocalServerClient`` is veRL's own ``LLMServerClient`` (its ``generate`` runs unchanged),
  with the Ray load balancer replaced by this one replica.
- ``MemoryTQ`` stands in for TransferQueue (whose controller and storage are Ray actors, too
  heavy for two shared cores); it packs fields with TransferQueue's own packer, so the trainer
  code reads back the jagged layout it reads from the real store.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from memsearcher.llm.base import SamplingParams
from memsearcher.llm.hf import HFModel


class HFReplica:
    """One rollout replica over ``HFModel``, with vLLM's ``generate`` signature."""

    def __init__(self, llm: HFModel, global_steps: int = 0) -> None:
        self.llm = llm
        self.global_steps = global_steps
        self.calls: list[dict[str, Any]] = []

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: Any = None,
        video_data: Any = None,
        **_: Any,
    ) -> TokenOutput:
        await asyncio.sleep(0)  # a real server's answer comes later: other sessions go on
        params = dict(sampling_params)
        self.calls.append({"request_id": request_id, "params": dict(params)})
        room = self.llm.max_context_tokens - len(prompt_ids)
        max_tokens = max(1, min(int(params.get("max_tokens", room)), room))
        temperature = float(params.get("temperature", 1.0))
        ours = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=temperature,
            top_p=float(params.get("top_p", 1.0)),
            stop=tuple(params.get("stop") or ()),
        )
        (completion,) = self.llm.generate([prompt_ids], ours)
        token_ids = list(completion.token_ids)
        log_probs = (
            self.logprobs(prompt_ids, token_ids, temperature) if params.get("logprobs") else None
        )
        return TokenOutput(
            token_ids=token_ids,
            log_probs=log_probs,
            stop_reason="completed",  # vLLM's answer for both a stop and a length cut
            extra_fields={"global_steps": self.global_steps},
        )

    @torch.no_grad()
    def logprobs(self, prompt: list[int], generated: list[int], temperature: float) -> list[float]:
        ids = torch.tensor([prompt + generated])
        logits = self.llm.model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        if temperature > 0:
            logits = logits / temperature
        picked = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(generated)[:, None])
        return [float(x) for x in picked[:, 0]]


class _Method:
    def __init__(self, method: Any) -> None:
        self.method = method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        return self.method(*args, **kwargs)  # a coroutine: awaited as Ray's ObjectRef would be


class _Handle:
    """What veRL awaits as ``server.generate.remote(...)``."""

    def __init__(self, replica: HFReplica) -> None:
        self.generate = _Method(replica.generate)


class LocalServerClient(LLMServerClient):
    """veRL's client with one local replica instead of Ray's load balancer."""

    def __init__(self, config: Any, replica: HFReplica) -> None:
        super().__init__(config=config, load_balancer_handle=None)
        self.handle = _Handle(replica)
        self.sessions: list[str] = []

    async def _acquire_server(self, request_id: str, **extra: Any) -> tuple[str, Any]:
        self.sessions.append(request_id)
        return "local", self.handle

    def _release_server(self, server_id: str, request_id: str | None = None) -> None:
        return None


def _unbind(value: Any) -> list[Any]:
    return list(value.unbind(0)) if isinstance(value, torch.Tensor) else list(value.tolist())


class MemoryTQ:
    """TransferQueue's key-value calls that the V1 worker and trainer make, over a dict."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, Any]] = {}
        self.tags: dict[str, Any] = {}

    def init(self, *args: Any, **kwargs: Any) -> None:
        return None

    async def async_kv_put(self, key: str, partition_id: str, tag: Any = None, **_: Any) -> None:
        self.tags[key] = tag

    async def async_kv_batch_put(
        self, keys: list[str], fields: TensorDict, tags: list[dict], partition_id: str
    ) -> None:
        self.kv_batch_put(keys=keys, partition_id=partition_id, fields=fields, tags=tags)

    def kv_batch_put(
        self,
        keys: list[str],
        partition_id: str,
        fields: TensorDict | None = None,
        tags: list[dict] | None = None,
    ) -> KVBatchMeta:
        if fields is not None:
            for name in fields.keys():  # noqa: SIM118  # iterating a TensorDict walks its rows
                for key, value in zip(keys, _unbind(fields.get(name)), strict=True):
                    self.rows.setdefault(key, {})[name] = value
        for key, tag in zip(keys, tags or [{}] * len(keys), strict=True):
            self.tags[key] = tag
        return KVBatchMeta(
            keys=list(keys), tags=[self.tags[k] for k in keys], partition_id=partition_id
        )

    def kv_batch_get(
        self, keys: list[str], partition_id: str, select_fields: list[str]
    ) -> TensorDict:
        pack = AsyncSimpleStorageManager._pack_field_values
        present = [f for f in select_fields if all(f in self.rows[k] for k in keys)]
        return TensorDict(
            {f: pack([self.rows[k][f] for k in keys]) for f in present}, batch_size=[len(keys)]
        )
