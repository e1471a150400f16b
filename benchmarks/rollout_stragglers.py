"""Stragglers in batched rollouts: our decoder, whose rows leave the batch as they end, against
transformers' ``generate``, which computes every row until the batch's longest one ends.

Prompts are the real MemSearcher contexts of the embedded SmolLM2-135M on questions about the
embedded Wikipedia: the first action (system + question) and, after a real BM25 search, the
memory update (the passages in the context). Both decoders sample plain softmax(logits / T) at
T=1 with the same budgets and one batch per phase; since they draw different samples, they are
compared by generated tokens per second, and by the share of row-steps that produced a token
(transformers: generated tokens / (rows x steps of the longest row)). Time spent checking stop
strings costs little beside the forward passes (0.1% of a batch's time, measured with the
former criterion). Runs alternate; the best of ``--repeats`` is kept (shared machine).

    python benchmarks/rollout_stragglers.py [--questions 16] [--max-new-tokens 256]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import torch

from memsearcher.agent import AgentConfig, start_episodes
from memsearcher.agent.base import Generate
from memsearcher.llm import load_llm
from memsearcher.llm.base import Completion, SamplingParams
from memsearcher.llm.hf import HFModel
from memsearcher.retrieval import embedded_corpus_path, load_embedded_retriever, read_corpus
from memsearcher.types import QAExample


def phase_prompts(llm: HFModel, count: int) -> dict[str, tuple[list[list[int]], tuple[str, ...]]]:
    """The first action's and, after searching the question, the memory update's contexts."""
    examples = []
    for passage in read_corpus(embedded_corpus_path()):
        examples.append(QAExample(passage.id, f"What is {passage.title} known for?", ("x",)))
        if len(examples) == count:
            break
    episodes = start_episodes("memsearcher", examples, llm.tokenizer, AgentConfig())
    actions = [e.next_request() for e in episodes]
    assert all(isinstance(r, Generate) for r in actions)
    retriever = load_embedded_retriever()
    call = '{"name": "wikipedia_search", "arguments": {"query": "%s"}}'
    memories = []
    for episode, example in zip(episodes, examples, strict=True):
        text = f"<think> search </think><tool_call>{call % example.question}</tool_call>"
        episode.on_generation(Completion(tuple(llm.tokenizer.encode(text)), "stop"))
        episode.on_observation(retriever.search([example.question], 5)[0])
        request = episode.next_request()
        assert isinstance(request, Generate)
        memories.append(request)
    return {
        "action": ([list(r.prompt_ids) for r in actions], actions[0].stop),  # type: ignore[union-attr]
        "memory": ([list(r.prompt_ids) for r in memories], memories[0].stop),
    }


def ours(llm: HFModel, prompts: Sequence[list[int]], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    out = llm.generate(prompts, params)
    return time.perf_counter() - start, sum(len(c.token_ids) for c in out)


@torch.no_grad()
def transformers_generate(
    llm: HFModel, prompts: Sequence[list[int]], params: SamplingParams
) -> tuple[float, int, float]:
    """transformers' generate on the same batch, with the same stop strings and plain sampling;
    returns seconds, generated tokens and the share of row-steps that produced one."""
    from transformers import GenerationConfig

    tokenizer = llm.tokenizer
    pad, width = tokenizer.pad_token_id, max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    config = GenerationConfig(
        max_new_tokens=params.max_new_tokens, do_sample=True, temperature=params.temperature,
        top_k=0, top_p=1.0, eos_token_id=sorted(tokenizer.eos_token_ids), pad_token_id=pad,
        repetition_penalty=1.0,
    )  # fmt: skip
    window = max(len(s) for s in params.stop) + 1

    def stop_tails(input_ids: torch.Tensor, scores: torch.Tensor, **_: object) -> torch.Tensor:
        # the backend's former stopping criterion: decode each row's last few tokens
        tails = input_ids[:, max(width, input_ids.shape[1] - window) :].tolist()
        done = [any(s in tokenizer.decode(t) for s in params.stop) for t in tails]
        return torch.tensor(done)

    torch.manual_seed(0)
    start = time.perf_counter()
    output = llm.model.generate(
        input_ids=ids, attention_mask=mask, generation_config=config,
        stopping_criteria=[stop_tails],
    )  # fmt: skip
    seconds = time.perf_counter() - start
    lengths = [llm._finish(row, params).token_ids for row in output[:, width:].tolist()]
    tokens = sum(len(t) for t in lengths)
    return seconds, tokens, tokens / (len(prompts) * (output.shape[1] - width))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)

    llm = load_llm("embedded", device="cpu", batch_size=args.questions)
    assert isinstance(llm, HFModel)
    for phase, (prompts, stop) in phase_prompts(llm, args.questions).items():
        params = SamplingParams(args.max_new_tokens, temperature=1.0, seed=0, stop=stop)
        best_ours = best_theirs = 0.0
        share = 0.0
        for _ in range(args.repeats):
            seconds, tokens = ours(llm, prompts, params)
            best_ours = max(best_ours, tokens / seconds)
            seconds, tokens, share = transformers_generate(llm, prompts, params)
            best_theirs = max(best_theirs, tokens / seconds)
        mean_prompt = sum(map(len, prompts)) / len(prompts)
        print(
            f"{phase}: {len(prompts)} prompts of {mean_prompt:.0f} tokens, "
            f"{args.max_new_tokens} new at most, threads={torch.get_num_threads()}"
        )
        print(f"  transformers generate: {best_theirs:7.1f} tok/s, useful row-steps {share:.1%}")
        print(f"  ours (rows leave):     {best_ours:7.1f} tok/s")
        print(f"  ratio ours / transformers: {best_ours / best_theirs:.2f}")


if __name__ == "__main__":
    main()
