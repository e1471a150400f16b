"""The vLLM offline backend: token-id prompts in, token ids out, batched by vLLM on a GPU.

vllm is imported lazily (``pip install vllm`` on a CUDA machine); nothing else in the package
needs it. Prompts go in as ``TokensPrompt`` so the model sees exactly the agent's tokens, the
stop string stays in the output (``include_stop_str_in_output``), and each prompt samples with
its own seed so that a group of identical prompts does not produce identical trajectories.
Sampling is plain (`memsearcher.llm.base.NEUTRAL_PROCESSORS`), as in every backend.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from memsearcher.errors import MemSearcherError
from memsearcher.llm.base import (
    NEUTRAL_PROCESSORS,
    Completion,
    SamplingParams,
    Tokenizer,
    derive_seed,
)
from memsearcher.types import FinishReason

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install vllm (needs a CUDA GPU)"


def _vllm() -> Any:
    try:
        import vllm
    except ImportError as error:
        raise MemSearcherError(f"the vllm backend needs vllm ({error}): {INSTALL_HINT}") from None
    return vllm


class VLLMModel:
    """An `LLM` over ``vllm.LLM``: ``VLLMModel.from_pretrained("Qwen/Qwen2.5-3B-Instruct")``."""

    def __init__(self, engine: Any, tokenizer: Tokenizer) -> None:
        self.engine = engine
        self._tokenizer = tokenizer

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        gpu_memory: float = 0.85,
        dtype: str = "auto",
        max_model_len: int | None = None,
        seed: int = 0,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        **engine_options: Any,
    ) -> VLLMModel:
        """Start a vLLM engine on ``path`` (an HF folder or hub id)."""
        from memsearcher.llm.tokenizer import load_tokenizer

        vllm = _vllm()
        engine = vllm.LLM(
            model=path,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory,
            max_model_len=max_model_len,
            seed=seed,
            enable_prefix_caching=True,  # every turn of a group shares the system prompt
            **engine_options,
        )
        return cls(engine, load_tokenizer(path, chat_template_kwargs))

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def max_context_tokens(self) -> int:
        return int(self.engine.llm_engine.model_config.max_model_len)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams
    ) -> list[Completion]:
        vllm = _vllm()
        from vllm.inputs import TokensPrompt

        sampling = [
            vllm.SamplingParams(
                n=1,
                temperature=params.temperature,
                top_p=params.top_p if params.temperature > 0 else 1.0,
                max_tokens=params.max_new_tokens,
                stop=list(params.stop) or None,
                include_stop_str_in_output=True,
                skip_special_tokens=False,
                seed=None if params.seed is None else derive_seed(params.seed, i),
                **NEUTRAL_PROCESSORS,
            )
            for i in range(len(prompts))
        ]
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        outputs = self.engine.generate(inputs, sampling_params=sampling, use_tqdm=False)
        return [self._completion(output.outputs[0]) for output in outputs]

    def _completion(self, output: Any) -> Completion:
        tokens = tuple(int(t) for t in output.token_ids)
        finish: FinishReason = "length" if output.finish_reason == "length" else "stop"
        eos = self._tokenizer.eos_token_ids
        stopped_itself = finish == "stop" and not isinstance(output.stop_reason, str)
        if stopped_itself and eos and (not tokens or tokens[-1] not in eos):
            # vLLM keeps the EOS token in token_ids; a stop token id it was told about may not be
            tokens += (min(eos),)
        return Completion(tokens, finish)
