"""The embedded agent's recipe: SmolLM2-135M taught by SFT on an imperfect teacher, then by
multi-context GRPO, over the embedded Wikipedia, on a CPU; evaluated and reported.

Every stage writes into its own folder of ``out`` and is skipped or resumed when the recipe is
run again, so an interrupted build loses at most one checkpoint interval::

    OUT/recipe.json            the config that made the folder (a rerun must match it)
    OUT/data/                  protocol.jsonl (+ .stats.json): the teacher's SFT trajectories;
                               questions/rl.jsonl and questions/test.jsonl (FlashRAG rows)
    OUT/sft/                   train_sft checkpoints: a LoRA adapter over the raw model
    OUT/models/sft/            the raw model with the SFT adapter merged in: GRPO's start,
                               unless a second pass follows:
    OUT/data/turn1.jsonl, OUT/sft-turn1/, OUT/models/sft-turn1/
                               with ``turn1_steps`` > 0, a second SFT pass (a fresh LoRA over
                               models/sft) on turn 1 of every Wikipedia trajectory: then this
                               merged model is GRPO's start, and the SFT model evaluated
    OUT/grpo-<agent>/          train_grpo checkpoints: a LoRA adapter over GRPO's start
    OUT/data/questions/select.jsonl, OUT/select/<agent>-step<N>/, OUT/grpo-<agent>/selection.json
                               with ``select_every`` > 0, questions of synthetic worlds that
                               neither SFT nor GRPO saw, every select_every-th checkpoint's
                               greedy predictions on them, and their EM: the best checkpoint
                               is the one kept below (else the last)
    OUT/models/grpo-<agent>/   GRPO's start with the kept GRPO adapter merged in
    OUT/adapters/              the adapters as the package ships them (float16, model cards)
    OUT/eval/<model>-<agent>/  predictions on the held-out and the test questions
    OUT/timings.json, OUT/results.json, OUT/report.md, OUT/reward_per_step.png
    OUT/superseded/grpo-<N>-steps/   what N GRPO steps made, moved here when a rerun raises
                               ``grpo.steps`` (GRPO trains on; `memsearcher.recipe.run_folder`)

With ``ship`` set, the SFT adapter (and the turn-1 one), and MemSearcher's GRPO adapter are also
written into that folder (the package's ``llm/adapters``); `memsearcher.llm.embedded.STACKS`
says which stacks the ``embedded`` and ``embedded-sft`` models are.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

from memsearcher.config import config_to_dict, default_dict
from memsearcher.data.compose import write_examples
from memsearcher.data.flashrag import read_examples
from memsearcher.errors import MemSearcherError
from memsearcher.eval.run import EvalConfig, run_eval
from memsearcher.llm.base import Tokenizer
from memsearcher.llm.embedded import merge_adapters
from memsearcher.recipe.adapters import BASE_ID, grpo_card, sft_card, ship, turn1_card
from memsearcher.recipe.config import RecipeConfig
from memsearcher.recipe.report import analyse
from memsearcher.recipe.run_folder import StageClock, claim
from memsearcher.rl.checkpoint import latest_checkpoint
from memsearcher.rl.config import GRPOConfig, SFTConfig
from memsearcher.rl.export import export_adapter, machine
from memsearcher.teach.oracle import AGENTS, oracle_policy
from memsearcher.teach.protocol_data import (
    answerable,
    answered_right,
    build_protocol_data,
    wiki_splits,
    world_rl_questions,
)
from memsearcher.teach.wiki import WikiQuestion
from memsearcher.types import QAExample

__all__ = ["claim_out", "run_recipe"]

Echo = Callable[[str], None]


def claim_out(config: RecipeConfig) -> None:
    """Make ``config.out`` this run's folder, or refuse it (`run_folder.claim`)."""
    claim(Path(config.out), config_to_dict(config), default_dict(RecipeConfig))


def run_recipe(config: RecipeConfig, echo: Echo = print) -> dict[str, Any]:
    """Run (or resume) every stage into ``config.out``; return the results."""
    out = Path(config.out)
    claim_out(config)
    clock = StageClock(out)

    @contextlib.contextmanager
    def stage(name: str) -> Iterator[None]:
        echo(f"[recipe] {name} ...")
        with clock.stage(name):
            yield
        echo(f"[recipe] {name}: {clock.seconds.get(name, 0.0)} s")

    with stage("data"):
        questions = build_data(config, out / "data", echo)
    with stage("SFT"):
        sft_model = train_sft_stage(config, out, echo)
    if config.turn1_steps:
        with stage("SFT (turn 1)"):
            sft_model = train_turn1_stage(config, sft_model, out, echo)
    grpo_models = {}
    for agent in config.agents:
        with stage(f"GRPO ({agent})"):
            grpo_models[agent] = train_grpo_stage(config, agent, sft_model, out, echo)
    with stage("evaluation"):
        evaluations = evaluate(config, questions, sft_model, grpo_models, out, echo)
    results = {
        "analysis": analyse(out, config.agents, config.bootstrap),
        "config": config_to_dict(config),
        "data": json.loads((out / "data" / "protocol.stats.json").read_text("utf-8")),
        "questions": {name: _describe(rows) for name, rows in questions.items()},
        "evaluations": evaluations,
        "timings": clock.seconds,
        "machine": machine(),
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n", "utf-8")
    if config.ship:
        ship(config, Path(config.ship), results)
        echo(f"[recipe] adapters written into {config.ship}")
    return results


# -- data ---------------------------------------------------------------------------------


def build_data(config: RecipeConfig, folder: Path, echo: Echo) -> dict[str, list[QAExample]]:
    """The teacher's SFT trajectories and the rl and test questions (each answerable by the
    ideal teacher through the real index, at the evaluation's passages per search); built
    once."""
    from memsearcher.llm import load_tokenizer
    from memsearcher.retrieval import open_retriever

    files = {"rl": folder / "questions" / "rl.jsonl", "test": folder / "questions" / "test.jsonl"}
    protocol = folder / "protocol.jsonl"
    tokenizer = load_tokenizer(config.base)
    if not protocol.is_file():
        build_protocol_data(config.build, protocol, tokenizer, echo)
    if not all(f.is_file() for f in files.values()):
        splits = wiki_splits(config.build)
        retriever = open_retriever(None)
        teacher = replace(config.build.agent, top_n=config.evaluation.top_n)
        for name, one_hop in (("rl", config.rl_one_hop), ("test", config.test_one_hop)):
            chosen = _two_hop_first(splits[name], one_hop)
            kept = answerable(chosen, tokenizer, retriever, teacher)
            write_examples(files[name], [q.to_example() for q in kept], overwrite=True)
    worlds = config.build.worlds  # the first world after the SFT data's
    if config.rl_worlds and not (folder / "questions" / "grpo.jsonl").is_file():
        # GRPO's questions: the Wikipedia rl split's and the rl_worlds' multi-hop ones
        rl = read_examples(files["rl"])
        rl += _world_questions(config, folder / "rl", worlds, config.rl_worlds,
                               config.rl_world_questions, tokenizer)  # fmt: skip
        write_examples(folder / "questions" / "grpo.jsonl", rl, overwrite=True)
    if config.select_every and not (folder / "questions" / "select.jsonl").is_file():
        selection = _world_questions(config, folder / "select", worlds + config.rl_worlds,
                                     config.select_worlds, config.select_world_questions,
                                     tokenizer)  # fmt: skip
        two_hop = [e for e in selection if len(e.metadata["hops"]) == 2]
        if not two_hop:
            raise MemSearcherError(
                f"no two-hop selection question the teacher answers among {len(selection)} "
                "of the select_worlds: raise select_worlds or select_world_questions"
            )
        write_examples(folder / "questions" / "select.jsonl", two_hop, overwrite=True)
    return {name: read_examples(path) for name, path in files.items()}


def _world_questions(
    config: RecipeConfig, stem: Path, first: int, worlds: int, per_world: int, tokenizer: Tokenizer
) -> list[QAExample]:
    """The multi-hop rl questions, ``per_world`` each, of the ``worlds`` synthetic worlds from
    number ``first`` on, that the ideal teacher answers through the index ``<stem>-index``
    (the embedded Wikipedia's passages and these worlds', ``<stem>-corpus.jsonl``)."""
    from memsearcher.retrieval.bm25 import build_bm25
    from memsearcher.retrieval.corpus import write_corpus
    from memsearcher.retrieval.embedded import embedded_passages

    passages, examples = world_rl_questions(replace(config.build, worlds=first), worlds, per_world)
    corpus = stem.with_name(f"{stem.name}-corpus.jsonl")
    write_corpus(corpus, embedded_passages() + passages)
    index = build_bm25(corpus, stem.with_name(f"{stem.name}-index"), overwrite=True)
    teacher = replace(config.build.agent, top_n=config.evaluation.top_n)
    right = answered_right(examples, oracle_policy(examples), tokenizer, index, teacher)
    return [example for example, ok in zip(examples, right, strict=True) if ok]


def _two_hop_first(questions: list[WikiQuestion], one_hop: int) -> list[WikiQuestion]:
    """Every two-hop question, then ``one_hop`` one-hop ones spread evenly over the one-hop
    questions sorted by their text."""
    two = [q for q in questions if len(q.chain) == 2]
    singles = sorted((q for q in questions if len(q.chain) == 1), key=lambda q: q.question)
    stride = max(1, len(singles) // max(one_hop, 1))
    return two + singles[::stride][:one_hop]


def _describe(examples: list[QAExample]) -> dict[str, int]:
    hops = [int(e.metadata.get("hops", 1)) for e in examples]
    return {"questions": len(hops), "two_hop": hops.count(2), "one_hop": hops.count(1)}


# -- training -----------------------------------------------------------------------------


def train_sft_stage(config: RecipeConfig, out: Path, echo: Echo) -> Path:
    """SFT of the raw model on the teacher's data, resumed from its last checkpoint; then its
    adapter merged into the raw model (``models/sft``) and exported (``adapters/sft``)."""
    sft = replace(config.sft, data=str(out / "data" / "protocol.jsonl"),
                  output_dir=str(out / "sft"))  # fmt: skip
    return _sft(sft, Path(config.base), out, lambda: sft_card(config, out), echo)


def train_turn1_stage(config: RecipeConfig, start: Path, out: Path, echo: Echo) -> Path:
    """The second SFT pass (``turn1_steps``): a fresh LoRA over the SFT model ``start`` on turn
    1 of every Wikipedia trajectory (``data/turn1.jsonl``), resumed from its last checkpoint;
    merged into ``start`` (``models/sft-turn1``) and exported (``adapters/sft-turn1``)."""
    data = out / "data" / "turn1.jsonl"
    if not data.is_file():
        write_turn1_data(out / "data" / "protocol.jsonl", data)
    sft = replace(
        config.sft,
        data=str(data),
        output_dir=str(out / "sft-turn1"),
        steps=config.turn1_steps,
        model=replace(config.sft.model, path=str(start)),
        optim=replace(config.sft.optim, lr=config.turn1_lr),
    )
    return _sft(sft, start, out, lambda: turn1_card(config, out), echo)


def write_turn1_data(protocol: Path, target: Path) -> None:
    """Turn 1's sequence of every Wikipedia trajectory of ``protocol`` (the teacher's data),
    each row a one-sequence trajectory: MemSearcher's turn after its first search (a second
    search on a two-hop question, else the answer) and ReAct's whole trajectory (one
    sequence holds all its turns). Synthetic worlds' trajectories are left out."""
    rows = []
    with protocol.open(encoding="utf-8") as lines:
        for line in lines:
            row = json.loads(line)
            if "chain" not in row["example"]["metadata"]:  # a synthetic world's
                continue
            turn = next(t for t in row["turns"] if t["index"] == 1)
            rows.append({**row, "sequences": [row["sequences"][turn["sequence_index"]]]})
    staging = target.with_name(target.name + ".partial")
    staging.write_text("".join(json.dumps(row) + "\n" for row in rows), "utf-8")
    staging.rename(target)


def _sft(sft: SFTConfig, start: Path, out: Path, card: Callable[[], str], echo: Echo) -> Path:
    """`_adapter_stage` for ``train_sft``."""
    from memsearcher.rl.train_sft import train_sft

    return _adapter_stage(
        sft, lambda resume: train_sft(sft, resume=resume, echo=echo), start, out, card
    )


def _adapter_stage(
    trainer: SFTConfig | GRPOConfig,
    run: Callable[[bool], Any],
    start: Path,
    out: Path,
    card: Callable[[], str],
    choose: Callable[[], Path] | None = None,
) -> Path:
    """Train (or resume) ``trainer`` to its last step; merge the adapter of that checkpoint,
    or of the one ``choose`` returns, into ``start`` as ``models/<name>`` and export it as
    ``adapters/<name>``, ``name`` being its output folder's; the merged model."""
    final = _train(trainer, run)
    if choose is not None:
        final = choose()
    name = Path(trainer.output_dir).name
    merged = out / "models" / name
    if not (merged / "config.json").is_file():
        _merge(start, final / "model", merged)
    exported = out / "adapters" / name
    if not (exported / "README.md").is_file():  # the card is written last
        export_adapter(final / "model", exported, card(), BASE_ID)
    return merged


def train_grpo_stage(config: RecipeConfig, agent: str, start: Path, out: Path, echo: Echo) -> Path:
    """GRPO of ``agent`` from the SFT model on the rl questions, resumed from its last
    checkpoint; then its adapter merged (``models/grpo-<agent>``) and exported."""
    from memsearcher.rl.train_grpo import train_grpo

    questions = out / "data" / "questions"
    grpo = replace(
        config.grpo,
        data=str(questions / ("grpo.jsonl" if config.rl_worlds else "rl.jsonl")),
        retriever=str(out / "data" / "rl-index") if config.rl_worlds else None,
        output_dir=str(out / f"grpo-{agent}"),
        agent_name=agent,
        model=replace(config.grpo.model, path=str(start)),
    )
    return _adapter_stage(
        grpo,
        lambda resume: train_grpo(grpo, resume=resume, echo=echo),
        start,
        out,
        lambda: grpo_card(config, agent, out),
        partial(select_checkpoint, config, agent, start, out, echo)
        if config.select_every
        else None,
    )


def select_checkpoint(config: RecipeConfig, agent: str, start: Path, out: Path, echo: Echo) -> Path:
    """Score every ``select_every``-th checkpoint of ``agent``'s GRPO run, and its last,
    greedily as ``agent`` on the selection questions (``select/<agent>-step<N>/``, resumable);
    record the scores in ``grpo-<agent>/selection.json``; the best checkpoint, the earliest
    on a tie."""
    from memsearcher.llm.hf import HFModel
    from memsearcher.retrieval import open_retriever

    run = out / f"grpo-{agent}"
    questions = {"select": read_examples(out / "data" / "questions" / "select.jsonl")}
    retriever = open_retriever(str(out / "data" / "select-index"))
    evaluation = EvalConfig(agent=agent, agent_config=config.evaluation, batch_size=64)
    last = config.grpo.steps
    scores: dict[int, float] = {}
    for step in sorted({*range(config.select_every, last, config.select_every), last}):
        folder = out / "select" / f"{agent}-step{step}"
        summary_file = folder / "summary.json"
        if not summary_file.is_file():
            model = out / "select" / f"{agent}-step{step}-model"  # ours, removed after use
            if not (model / "config.json").is_file():
                _merge(start, run / f"step-{step}" / "model", model)
            llm = HFModel.from_pretrained(
                str(model), device=config.grpo.model.device, batch_size=64
            )
            run_eval(questions, llm, retriever, evaluation, folder,
                     info={"model": f"grpo-{agent}", "step": step}, progress=False)  # fmt: skip
            shutil.rmtree(model)
        summary = json.loads(summary_file.read_text("utf-8"))
        scores[step] = summary["datasets"]["select"]["em"]
        echo(f"[recipe] selection: {agent} step {step} EM {scores[step]:.3f}")
    best = max(scores, key=lambda step: (scores[step], -step))
    record = {"questions": len(questions["select"]), "em": scores, "chosen": best}
    (run / "selection.json").write_text(json.dumps(record, indent=2) + "\n", "utf-8")
    echo(f"[recipe] selection: {agent} keeps step {best} of {last}")
    return run / f"step-{best}"


def _train(trainer: SFTConfig | GRPOConfig, run: Callable[[bool], Any]) -> Path:
    """The final checkpoint of ``trainer``'s run, training (or resuming) it first if it is not
    there yet."""
    output = Path(trainer.output_dir)
    last = latest_checkpoint(output)
    steps = trainer.steps
    if last is None or _step(last) < steps:
        run(last is not None)
        last = latest_checkpoint(output)
    if last is None or _step(last) != steps:
        raise MemSearcherError(f"{output}: training ended without its step-{steps} checkpoint")
    return last


def _step(checkpoint: Path) -> int:
    return int(checkpoint.name.split("-")[1])


def _merge(base: Path, adapter: Path, target: Path) -> None:
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)  # our own, left by an interrupted merge
    merge_adapters(base, [adapter], staging)
    staging.rename(target)


# -- evaluation ---------------------------------------------------------------------------


def evaluate(
    config: RecipeConfig,
    questions: dict[str, list[QAExample]],
    sft_model: Path,
    grpo_models: dict[str, Path],
    out: Path,
    echo: Echo,
) -> dict[str, Any]:
    """Greedy evaluation of the SFT model (GRPO's start) as every agent and of each GRPO model
    as its agent, on the held-out and the test questions (resumable: `run_eval` skips what is
    saved), on GRPO's device (``grpo.model.device``); the summaries by run."""
    from memsearcher.llm.hf import HFModel
    from memsearcher.retrieval import open_retriever

    limit = config.evaluation_limit or None
    datasets = {"heldout": read_examples(config.build.heldout)[:limit],
                "test": questions["test"][:limit]}  # fmt: skip
    retriever = open_retriever(None)
    loaded: dict[Path, HFModel] = {}
    summaries: dict[str, Any] = {}
    runs = [("sft", agent, sft_model) for agent in AGENTS]
    runs += [("grpo", agent, path) for agent, path in grpo_models.items()]
    for model, agent, path in runs:
        if path not in loaded:
            loaded[path] = HFModel.from_pretrained(
                str(path), device=config.grpo.model.device, batch_size=64
            )
        run = out / "eval" / f"{model}-{agent}"
        evaluation = EvalConfig(agent=agent, agent_config=config.evaluation, batch_size=64)
        started = time.perf_counter()
        summary = run_eval(datasets, loaded[path], retriever, evaluation, run,
                           info={"model": f"{model}-{agent}"}, progress=False)  # fmt: skip
        summary["seconds"] = round(time.perf_counter() - started, 1)
        summaries[f"{model}/{agent}"] = summary
        ems = ", ".join(f"{d} {s['em']:.3f}" for d, s in summary["datasets"].items())
        echo(f"[recipe] {model:>4} {agent:<11} EM {ems}")
    return summaries
