"""An evaluation run: every question of every dataset, one prediction line each, and a summary.

Layout of a run folder::

    OUT/settings.json                 what produced the predictions (checked on resume)
    OUT/<dataset>/predictions.jsonl   one line per finished question, with its trajectory
    OUT/summary.json                  metrics per dataset and their average

Predictions are appended and flushed one question at a time (`memsearcher.eval.predictions`),
so an interrupted run loses at most the questions in flight. Restarting with the same ``--out``
skips every id already saved; a torn last line (the process died mid-write) is dropped and its
question redone. The summary is always recomputed from the saved predictions, so it covers the
questions of every attempt; an id saved more than once counts once, by its last line.

A question that fails on its own (its batch is retried one question at a time to find it) is
saved as an ``end_reason: "error"`` line with the error, and the run goes on; a rerun tries it
again. Many failures in a row mean the setup is broken, not a question, and stop the run.
One run at a time writes to a folder: a second gets a clear error (a lock in ``OUT/.lock``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from memsearcher.agent import (
    AgentConfig,
    Templates,
    agent_type,
    run_lockstep,
)
from memsearcher.agent.environments import Environment
from memsearcher.agent.shop_agents import ShopTemplates
from memsearcher.agent.tasks import ENVIRONMENTS
from memsearcher.config import changed_keys
from memsearcher.errors import MemSearcherError
from memsearcher.eval.predictions import (
    PredictionWriter,
    error_record,
    latest_records,
    prediction_record,
    read_predictions,
)
from memsearcher.folders import exclusive
from memsearcher.llm.base import LLM, SamplingParams, is_async
from memsearcher.retrieval.base import Retriever
from memsearcher.types import QAExample, Trajectory

logger = logging.getLogger(__name__)

__all__ = ["EvalConfig", "run_eval", "summarize"]

FORMAT_FAILURES = frozenset({"format_error", "length"})
"""End reasons that mean the model broke the protocol (DESIGN section 5: not well formed)."""
PERCENTILES = (50, 90, 99)
LOCK = ".lock"
MAX_ERRORS_IN_A_ROW = 10
"""Questions failing one after another before the run stops: the setup, not a question, is bad."""


@dataclass(frozen=True)
class EvalConfig:
    """How questions are answered during evaluation."""

    agent: str = "memsearcher"
    """Which agent answers: a key of ``memsearcher.agent.AGENTS`` (memsearcher, react, mem1)."""
    agent_config: AgentConfig = field(default_factory=lambda: AgentConfig(max_turns=20))
    """Its turn and generation budgets and passages per search (20 turns, as the paper's
    evaluation)."""
    temperature: float = 0.0
    """0 decodes greedily, the evaluation default."""
    seed: int = 0
    """Base seed for sampling (used when temperature > 0)."""
    driver: str = "lockstep"
    """``lockstep`` (in-process backends) or ``async`` (HTTP backends that batch themselves)."""
    batch_size: int = 16
    """Questions per lockstep round; each round's predictions are saved when it ends."""
    concurrency: int = 64
    """Episodes in flight at once with the async driver."""
    environment: str = "search"
    """What the episodes act in: ``search`` (questions over a retriever), ``shop`` (the
    generated shop's instructions) or ``webshop`` (a WebShop server's sessions)."""

    def __post_init__(self) -> None:
        agent_type(self.agent)
        if self.driver not in DRIVERS:
            raise ValueError(f"unknown driver {self.driver!r}; choose one of {sorted(DRIVERS)}")
        if self.environment not in ENVIRONMENTS:
            raise ValueError(
                f"unknown environment {self.environment!r}; choose one of {sorted(ENVIRONMENTS)}"
            )
        for name in ("batch_size", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, seed=self.seed)

    def settings(self) -> dict[str, Any]:
        """The fields that change predictions (a resumed run must keep them), flat, under the
        keys run folders have always saved, so that older runs still resume."""
        agent = self.agent_config
        settings: dict[str, Any] = {
            "agent": self.agent,
            "max_turns": agent.max_turns,
            "max_new_tokens": agent.max_new_tokens,
            "memory_tokens": agent.memory_tokens,
            "top_n": agent.top_n,
            "temperature": self.temperature,
            "seed": self.seed,
        }
        if agent.max_top_n != max(agent.top_n, AgentConfig.max_top_n):  # absent from older runs
            settings["max_top_n"] = agent.max_top_n
        if self.environment != "search":  # the same
            settings["environment"] = self.environment
        if agent.answer_on_repeat:  # the same
            settings["answer_on_repeat"] = True
        return settings


# -- summary -----------------------------------------------------------------------------------


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Metrics of one dataset from its prediction records."""
    n = len(records)
    if n == 0:
        return {"questions": 0}
    prompt_tokens = [t for r in records for t in r["prompt_tokens"]]
    longest = max((len(r["prompt_tokens"]) for r in records), default=0)
    by_turn = [
        [r["prompt_tokens"][k] for r in records if len(r["prompt_tokens"]) > k]
        for k in range(longest)
    ]
    reasons: dict[str, int] = {}
    for r in records:
        reasons[r["end_reason"]] = reasons.get(r["end_reason"], 0) + 1
    tokens = np.asarray(prompt_tokens or [0], dtype=np.float64)
    # records saved before these fields existed have none of them
    peaks = [r["peak_tokens"] for r in records if "peak_tokens" in r]
    seconds = [r["seconds"] for r in records if r.get("seconds") is not None]
    return {
        "questions": n,
        "objectives": float(np.mean([r.get("objectives", 1) for r in records])),
        "em": float(np.mean([r["em"] for r in records])),
        "f1": float(np.mean([r["f1"] for r in records])),
        "acc": float(np.mean([r["acc"] for r in records])),
        "mean_turns": float(np.mean([r["turns"] for r in records])),
        "searches_per_question": float(np.mean([r["searches"] for r in records])),
        "prompt_tokens_per_turn": {
            "mean": float(tokens.mean()),
            "max": float(tokens.max()),
            **{f"p{p}": float(np.percentile(tokens, p)) for p in PERCENTILES},
        },
        "prompt_tokens_by_turn": [float(np.mean(values)) for values in by_turn],
        "peak_tokens": {"mean": float(np.mean(peaks)), "max": float(np.max(peaks))}
        if peaks
        else None,
        "seconds_per_question": float(np.mean(seconds)) if seconds else None,
        "format_failure_rate": sum(reasons.get(k, 0) for k in FORMAT_FAILURES) / n,
        "answered_rate": reasons.get("answer", 0) / n,
        "asked_to_answer": sum(map(_asked_to_answer, records)),
        "end_reasons": dict(sorted(reasons.items())),
        **({"shop": shop_summary(records)} if any("reward" in r for r in records) else {}),
    }


def _asked_to_answer(record: dict[str, Any]) -> bool:
    """Whether the agent repeated a query and was asked for its answer (``answer_on_repeat``;
    under ``repeat_ends`` the repeat ended the episode instead)."""
    if record.get("end_reason") == "repeated_query":
        return False
    turns = (record.get("trajectory") or {}).get("turns", ())
    return any(turn.get("repeated_query") is not None for turn in turns)


LONG_EPISODE_STEPS = 8
"""Episodes of at least this many steps are where a growing context shows (ReAct's)."""


def shop_summary(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The shop's metrics: mean reward, success rate (reward 1: the right product with every
    option, within the price), mean steps (one action a turn), and the peak prompt tokens of
    an episode (the largest context the model saw), over all episodes and over those of at
    least `LONG_EPISODE_STEPS` steps. A failed episode (no trajectory) scores 0."""
    rewards = [r.get("reward") or 0.0 for r in records]
    peaks = [max(r["prompt_tokens"], default=0) for r in records]
    long = [p for p, r in zip(peaks, records, strict=True) if r["turns"] >= LONG_EPISODE_STEPS]
    return {
        "mean_reward": float(np.mean(rewards)),
        "success_rate": float(np.mean([reward == 1.0 for reward in rewards])),
        "mean_steps": float(np.mean([r["turns"] for r in records])),
        "peak_prompt_tokens": {"mean": float(np.mean(peaks)), "max": float(np.max(peaks))},
        "long_episodes": len(long),
        "peak_prompt_tokens_long": (
            {"mean": float(np.mean(long)), "max": float(np.max(long))} if long else None
        ),
    }


def _average(summaries: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Unweighted mean over datasets, as the paper's "Avg." column."""
    scored = [s for s in summaries.values() if s.get("questions")]
    if not scored:
        return {}
    keys = ("em", "f1", "acc", "mean_turns", "searches_per_question", "format_failure_rate")
    average = {k: float(np.mean([s[k] for s in scored])) for k in keys}
    if all(s.get("peak_tokens") for s in scored):
        average["peak_tokens"] = float(np.mean([s["peak_tokens"]["mean"] for s in scored]))
    return average


# -- running -------------------------------------------------------------------------------------

Done = Callable[[Trajectory], None]
Failed = Callable[[QAExample, Exception], None]


def _lockstep(
    examples: Sequence[QAExample],
    llm: Any,
    retriever: Retriever | Environment[Any, Any],
    config: EvalConfig,
    templates: Templates | ShopTemplates | None,
    on_done: Done,
    on_error: Failed,
) -> None:
    def answer(chunk: Sequence[QAExample]) -> list[Trajectory]:
        episodes = ENVIRONMENTS[config.environment].start_episodes(
            config.agent, chunk, llm.tokenizer, config.agent_config, templates,
            llm.max_context_tokens,
        )  # fmt: skip
        return run_lockstep(episodes, llm, retriever, config.sampling)

    for start in range(0, len(examples), config.batch_size):
        chunk = examples[start : start + config.batch_size]
        try:
            trajectories = answer(chunk)
        except Exception as error:  # find the question at fault; the others are answered
            if len(chunk) == 1:
                on_error(chunk[0], error)
                continue
            logger.warning("a batch failed (%s); answering its questions one at a time", error)
            for example in chunk:
                try:
                    (trajectory,) = answer([example])
                except Exception as single:
                    on_error(example, single)
                else:
                    on_done(trajectory)
            continue
        for trajectory in trajectories:
            on_done(trajectory)


def _async(
    examples: Sequence[QAExample],
    llm: Any,
    retriever: Retriever,
    config: EvalConfig,
    templates: Templates | ShopTemplates | None,
    on_done: Done,
    on_error: Failed,
) -> None:
    from memsearcher.agent.async_driver import run_async

    if not is_async(llm):
        raise MemSearcherError("the async driver needs an HTTP backend (--backend openai)")
    episodes = ENVIRONMENTS[config.environment].start_episodes(
        config.agent, examples, llm.tokenizer, config.agent_config, templates,
        llm.max_context_tokens,
    )  # fmt: skip

    async def run_all() -> None:
        from memsearcher.retrieval.client import AsyncHTTPRetriever, HTTPRetriever

        # a retrieval server gets its searches concurrently too, and batches them itself
        searcher: Any = retriever
        if isinstance(retriever, HTTPRetriever):
            searcher = AsyncHTTPRetriever(retriever.url)
        try:
            await run_async(
                episodes,
                llm,
                searcher,
                config.sampling,
                concurrency=config.concurrency,
                on_done=lambda _, trajectory: on_done(trajectory),
                on_error=lambda index, error: on_error(examples[index], error),
            )
        finally:
            for resource in (llm, searcher):
                close = getattr(resource, "aclose", None)
                if close is not None:
                    await close()

    asyncio.run(run_all())


DRIVERS: dict[str, Callable[..., None]] = {"lockstep": _lockstep, "async": _async}


def _read_run_file(path: Path, what: str, fits: Callable[[Any], bool]) -> Any:
    """The JSON eval saved at ``path``, or None where there is none. A file eval did not write
    (unreadable, not JSON, or not the shape eval writes) is refused, not overwritten: --out is
    then a folder of someone's files, not a run."""
    if not path.exists():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
        ours = fits(value)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        ours = False
    if not ours:
        raise MemSearcherError(
            f"{path} is not {what}, so {path.parent} is not an eval run folder; "
            "choose another --out (eval leaves files it did not write alone)"
        )
    return value


def _is_dict(value: Any) -> bool:
    return isinstance(value, dict)


def _is_summary(value: Any) -> bool:
    datasets = value.get("datasets") if isinstance(value, dict) else None
    return isinstance(datasets, dict) and all(isinstance(s, dict) for s in datasets.values())


def _check_settings(out: Path, saved: dict[str, Any] | None, settings: dict[str, Any]) -> None:
    if saved is not None:
        changed = changed_keys(saved, settings)
        if changed:
            raise MemSearcherError(
                f"{out} holds a run with other settings ({', '.join(changed)}); "
                "resume with the same settings or choose another --out"
            )
        return
    (out / "settings.json").write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")


def _check_names(names: Sequence[str]) -> None:
    """Each dataset's predictions go to ``OUT/<name>/``, so a name must be one folder name: a
    path would put them outside --out."""
    for name in names:
        if name in {"", ".", ".."} or Path(name).name != name or "\\" in name:
            raise MemSearcherError(
                f"dataset {name!r}: --datasets takes folder names inside --data, not paths "
                "(its predictions go to --out/NAME/)"
            )


def _answer_missing(
    name: str,
    examples: Sequence[QAExample],
    path: Path,
    llm: LLM,
    retriever: Retriever | Environment[Any, Any],
    config: EvalConfig,
    templates: Templates | ShopTemplates | None,
    progress: bool,
) -> None:
    """Run the questions of ``examples`` not yet in ``path``, appending each as it ends."""
    from tqdm import tqdm

    saved = latest_records(read_predictions(path))
    done = {r["id"] for r in saved if r["end_reason"] != "error"}
    todo = [e for e in examples if e.id not in done]
    logger.info("%s: %d questions, %d saved, %d to run", name, len(examples), len(done), len(todo))
    if not todo:
        return
    writer = PredictionWriter(path)
    errors_in_a_row = 0
    # Each record gets the wall time since the previous one was saved: batched questions finish
    # together, so one record's value means little, but their sum is the run's wall time and
    # their mean the amortized time per question, whatever the driver or batch size.
    last = time.perf_counter()
    with tqdm(total=len(examples), initial=len(examples) - len(todo), desc=name,
              disable=not progress, unit="q") as bar:  # fmt: skip

        def save(trajectory: Trajectory) -> None:
            nonlocal errors_in_a_row, last
            errors_in_a_row = 0
            now = time.perf_counter()
            writer.write(prediction_record(name, trajectory, round(now - last, 6)))
            last = now
            bar.update(1)

        def save_error(example: QAExample, error: Exception) -> None:
            nonlocal errors_in_a_row
            logger.error("%s: question %s failed: %s", name, example.id, error)
            writer.write(error_record(name, example, error))
            bar.update(1)
            errors_in_a_row += 1
            if errors_in_a_row >= MAX_ERRORS_IN_A_ROW:
                raise MemSearcherError(
                    f"{name}: the last {errors_in_a_row} questions all failed, so the setup is "
                    f"at fault, not a question; stopping (last error: {error})"
                ) from error

        try:
            DRIVERS[config.driver](todo, llm, retriever, config, templates, save, save_error)
        finally:
            writer.close()


def run_eval(
    datasets: dict[str, list[QAExample]],
    llm: LLM,
    retriever: Retriever | Environment[Any, Any],
    config: EvalConfig,
    out: str | Path,
    templates: Templates | ShopTemplates | None = None,
    info: dict[str, Any] | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Answer every question not yet saved under ``out``, then write and return the summary.

    ``info`` (model, retriever, ...) is saved with the settings and must match on resume.
    ``retriever`` is what the episodes act on: a retriever, or a shop's environment with
    ``config.environment`` ``shop`` or ``webshop``.
    """
    _check_names(list(datasets))
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise MemSearcherError(f"--out {out} is a file; choose a folder for the run")
    out.mkdir(parents=True, exist_ok=True)
    busy = (
        f"another eval is writing to {out} (it holds {out / LOCK}); "
        "wait for it to end or choose another --out"
    )
    with exclusive(out / LOCK, busy):
        return _run_locked(datasets, llm, retriever, config, out, templates, info, progress)


def _run_locked(
    datasets: dict[str, list[QAExample]],
    llm: LLM,
    retriever: Retriever | Environment[Any, Any],
    config: EvalConfig,
    out: Path,
    templates: Templates | ShopTemplates | None,
    info: dict[str, Any] | None,
    progress: bool,
) -> dict[str, Any]:
    # both read before anything is written or answered: a foreign file is refused up front
    saved = _read_run_file(out / "settings.json", "an eval run's settings", _is_dict)
    earlier = _read_run_file(out / "summary.json", "an eval run's summary", _is_summary)
    _check_settings(out, saved, {**config.settings(), **(info or {})})
    # datasets run earlier into the same folder stay in the summary
    summaries: dict[str, dict[str, Any]] = dict(earlier["datasets"]) if earlier else {}
    for name, examples in datasets.items():
        path = out / name / "predictions.jsonl"
        _answer_missing(name, examples, path, llm, retriever, config, templates, progress)
        wanted = {e.id for e in examples}
        records = [r for r in latest_records(read_predictions(path)) if r["id"] in wanted]
        summaries[name] = s = summarize(records)
        if not records:
            continue
        logger.info(
            "eval/%s: em=%.4f f1=%.4f acc=%.4f turns=%.2f format_failures=%.3f",
            name, s["em"], s["f1"], s["acc"], s["mean_turns"], s["format_failure_rate"],
        )  # fmt: skip
    summary = {
        "datasets": summaries,
        "average": _average(summaries),
        "settings": {**config.settings(), **(info or {})},
    }
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    tmp.replace(out / "summary.json")
    return summary
