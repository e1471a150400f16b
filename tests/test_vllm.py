"""The vLLM backend on a GPU, with the embedded model. Skipped without CUDA or vllm."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from memsearcher.agent import AgentConfig, run_lockstep, start_episodes
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.hf import HFModel
from memsearcher.retrieval.base import Retriever
from memsearcher.types import QAExample


def _gpu_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (pip install vllm on a CUDA machine)"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU: the vLLM backend needs one"
    return None


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_gpu_reason() is not None, reason=_gpu_reason() or ""),
]


@pytest.fixture(scope="module")
def vllm_model() -> Any:
    from memsearcher.llm.embedded import embedded_model_path
    from memsearcher.llm.vllm import VLLMModel

    return VLLMModel.from_pretrained(str(embedded_model_path()), gpu_memory=0.3)


def test_vllm_follows_the_completion_contract(vllm_model: Any, llm: HFModel) -> None:
    chat = [{"role": "user", "content": "Say hello."}]
    prompt = llm.tokenizer.encode(llm.tokenizer.render_chat(chat, add_generation_prompt=True))
    (cut,) = vllm_model.generate([prompt], SamplingParams(max_new_tokens=4))
    assert cut.finish_reason == "length" and len(cut.token_ids) == 4
    (done,) = vllm_model.generate([prompt], SamplingParams(max_new_tokens=128))
    if done.finish_reason == "stop":
        assert done.token_ids[-1] in llm.tokenizer.eos_token_ids
    (stopped,) = vllm_model.generate([prompt], SamplingParams(max_new_tokens=64, stop=("e",)))
    assert stopped.finish_reason == "stop"
    assert llm.tokenizer.decode(stopped.token_ids).count("e") >= 1
    # greedy vLLM agrees with greedy transformers on the first tokens
    (hf,) = llm.generate([prompt], SamplingParams(max_new_tokens=4))
    assert hf.token_ids[:2] == cut.token_ids[:2]
    # a seeded batch is reproducible, and identical prompts sample differently
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=3)
    first = vllm_model.generate([prompt] * 4, params)
    assert first == vllm_model.generate([prompt] * 4, params)
    assert len({c.token_ids for c in first}) > 1


def test_agent_runs_on_vllm(vllm_model: Any, retriever: Retriever) -> None:
    examples = [QAExample("q", "Who wrote Hamlet?", ("Shakespeare",))] * 4
    config = AgentConfig(max_turns=2, max_new_tokens=64, memory_tokens=64)
    episodes = start_episodes(
        "memsearcher", examples, vllm_model.tokenizer, config, None, vllm_model.max_context_tokens
    )
    trajectories = run_lockstep(episodes, vllm_model, retriever, SamplingParams(seed=0))
    assert all(t.turns and t.sequences for t in trajectories)
