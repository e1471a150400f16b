"""Evaluation runs: FlashRAG reading, resume after a kill, summary fields, the report.

The end-to-end tests run the real CLI on the embedded model and BM25 index. The untrained
135M model rarely follows the protocol, so EM is about 0; what is checked is the mechanics.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memsearcher.agent import AgentConfig
from memsearcher.agent.replay import search_then_answer
from memsearcher.cli import main
from memsearcher.data.flashrag import load_benchmarks, read_examples, resolve_dataset
from memsearcher.errors import MemSearcherError
from memsearcher.eval.metrics import exact_match
from memsearcher.eval.predictions import PredictionWriter, read_predictions
from memsearcher.eval.report import format_table, load_rows
from memsearcher.eval.run import EvalConfig, run_eval, summarize
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.hf import HFModel
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval.base import Retriever
from memsearcher.types import QAExample

ROWS = [
    {"id": "q0", "question": "Who wrote Hamlet?", "golden_answers": ["William Shakespeare"]},
    {"id": "q1", "question": "What is the capital of France?", "golden_answers": ["Paris"]},
    {"id": "q2", "question": "Which planet is the red planet?", "golden_answers": ["Mars"]},
    {"id": "q3", "question": "Who painted the Mona Lisa?", "golden_answers": ["Leonardo"]},
]
SMALL = ["--max-turns", "2", "--max-new-tokens", "32", "--memory-tokens", "32"]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


# -- reading FlashRAG files ----------------------------------------------------------------------


def test_dataset_names_resolve_to_flashrag_splits(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "nq" / "test.jsonl", ROWS[:2])
    write_jsonl(tmp_path / "hotpotqa" / "dev.jsonl", ROWS[2:])
    write_jsonl(tmp_path / "hotpotqa" / "test.jsonl", ROWS[:1])  # hidden answers: not used
    assert resolve_dataset(tmp_path, "hotpotqa").name == "dev.jsonl"
    assert resolve_dataset(tmp_path, "nq").name == "test.jsonl"
    found = load_benchmarks(tmp_path)
    assert list(found) == ["nq", "hotpotqa"]
    assert [e.id for e in found["hotpotqa"]] == ["q2", "q3"]
    assert list(load_benchmarks(tmp_path, ["nq"], limit=1)["nq"]) == [
        QAExample("q0", "Who wrote Hamlet?", ("William Shakespeare",))
    ]
    with pytest.raises(MemSearcherError, match="musique"):
        load_benchmarks(tmp_path, ["musique"])


def test_a_single_file_is_named_after_its_folder_or_stem(tmp_path: Path) -> None:
    split = write_jsonl(tmp_path / "popqa" / "test.jsonl", ROWS[:1])
    named = write_jsonl(tmp_path / "mine.jsonl", ROWS[:1])
    assert list(load_benchmarks(split)) == ["popqa"]
    assert list(load_benchmarks(named)) == ["mine"]
    with pytest.raises(MemSearcherError, match="--datasets"):
        load_benchmarks(named, ["nq"])
    with pytest.raises(MemSearcherError, match="none of the benchmarks"):
        load_benchmarks(tmp_path / "popqa")


def test_parquet_and_jsonl_read_the_same(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{**r, "id": i} for i, r in enumerate(ROWS)]  # integer ids become strings
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test.parquet")
    write_jsonl(tmp_path / "test.jsonl", rows)
    assert read_examples(tmp_path / "test.parquet") == read_examples(tmp_path / "test.jsonl")
    assert read_examples(tmp_path / "test.parquet")[0].id == "0"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"id": "a", "question": "q?"}, "golden_answers"),
        ({"id": "a", "question": " ", "golden_answers": ["x"]}, "question"),
        ({"id": "a", "question": "q?", "golden_answers": []}, "empty"),
    ],
)
def test_bad_rows_are_named(tmp_path: Path, row: dict, message: str) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    with pytest.raises(MemSearcherError, match=message):
        read_examples(path)


def test_duplicate_ids_are_refused(tmp_path: Path) -> None:
    with pytest.raises(MemSearcherError, match="duplicate id"):
        read_examples(write_jsonl(tmp_path / "d.jsonl", [ROWS[0], ROWS[0]]))


# -- predictions file and summary ------------------------------------------------------------------


def test_torn_last_line_is_ignored_and_cut(tmp_path: Path) -> None:
    path = tmp_path / "predictions.jsonl"
    path.write_text('{"id": "a"}\n{"id": "b"}\n{"id": "c", "pred', encoding="utf-8")
    assert [r["id"] for r in read_predictions(path)] == ["a", "b"]
    writer = PredictionWriter(path)
    writer.write({"id": "c"})
    writer.close()
    assert [r["id"] for r in read_predictions(path)] == ["a", "b", "c"]
    path.write_text('{"id": "a"}\nnot json\n{"id": "b"}\n', encoding="utf-8")
    with pytest.raises(MemSearcherError, match="damaged"):
        read_predictions(path)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.dictionaries(st.sampled_from(["id", "text", "n"]), st.text(max_size=10) | st.integers()),
        min_size=1,
        max_size=5,
    ),
    st.data(),
)
def test_a_cut_anywhere_loses_at_most_the_last_record(
    records: list[dict], data: st.DataObject
) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "predictions.jsonl"
        writer = PredictionWriter(path)
        for record in records:
            writer.write(record)
        writer.close()
        raw = path.read_bytes()
        cut = data.draw(st.integers(0, len(raw)))
        path.write_bytes(raw[:cut])
        kept = read_predictions(path)
        assert kept == records[: len(kept)]
        assert len(kept) >= raw[:cut].count(b"\n")
        writer = PredictionWriter(path)  # resuming cuts the torn tail before appending
        writer.write({"id": "next"})
        writer.close()
        # what counted as saved stays saved
        assert read_predictions(path) == [*kept, {"id": "next"}]


def test_summary_by_hand() -> None:
    def record(em: float, reason: str, tokens: list[int], searches: int) -> dict:
        return {
            "em": em, "f1": em / 2, "acc": 1.0, "end_reason": reason, "turns": len(tokens),
            "searches": searches, "prompt_tokens": tokens,
        }  # fmt: skip

    s = summarize(
        [
            record(1.0, "answer", [100, 120], 1),
            record(0.0, "format_error", [100], 0),
            record(0.0, "length", [100, 140, 160], 2),
            record(1.0, "answer", [100], 0)
            | {"trajectory": {"turns": [{"repeated_query": None}, {"repeated_query": "q"}]}},
        ]
    )
    assert s["questions"] == 4
    assert s["em"] == 0.5 and s["f1"] == 0.25 and s["acc"] == 1.0
    assert s["mean_turns"] == 7 / 4 and s["searches_per_question"] == 3 / 4
    assert s["format_failure_rate"] == 0.5 and s["answered_rate"] == 0.5
    assert s["asked_to_answer"] == 1
    assert s["prompt_tokens_by_turn"] == [100.0, 130.0, 160.0]
    tokens = s["prompt_tokens_per_turn"]
    assert tokens["p50"] == 100.0 and tokens["max"] == 160.0
    assert tokens["mean"] == pytest.approx(820 / 7)


# -- end to end ----------------------------------------------------------------------------------


def _cli(*args: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "memsearcher.cli", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
def test_eval_cli_survives_a_kill_and_resumes(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "data" / "nq" / "test.jsonl", ROWS)
    out = tmp_path / "run"
    args = ["eval", "--data", str(data.parent.parent), "--datasets", "nq", "--out", str(out)]
    args += [*SMALL, "--batch-size", "1", "--no-progress"]
    predictions = out / "nq" / "predictions.jsonl"
    first = _cli(*args)
    deadline = time.monotonic() + 240
    while len(read_predictions(predictions)) < 1 and first.poll() is None:
        assert time.monotonic() < deadline, "no prediction saved in time"
        time.sleep(0.2)
    first.send_signal(signal.SIGKILL)
    first.wait()
    saved = predictions.read_text(encoding="utf-8")
    kept = read_predictions(predictions)
    assert 1 <= len(kept) < len(ROWS), "the kill should land mid-run"

    second = _cli(*args)
    stdout, stderr = second.communicate(timeout=600)
    assert second.returncode == 0, stderr
    records = read_predictions(predictions)
    # the questions finished before the kill were not redone: their lines are untouched
    assert predictions.read_text(encoding="utf-8").startswith(saved.rsplit("\n", 1)[0])
    assert sorted(r["id"] for r in records) == [r["id"] for r in ROWS]
    assert [r["id"] for r in records[: len(kept)]] == [r["id"] for r in kept]

    summary = json.loads((out / "summary.json").read_text(encoding="utf-8"))
    nq = summary["datasets"]["nq"]
    recomputed = sum(
        exact_match(r["trajectory"]["answer"] or "", r["golden_answers"]) for r in records
    ) / len(records)
    assert nq["em"] == recomputed
    assert nq["questions"] == len(ROWS)
    for key in ("f1", "acc", "mean_turns", "searches_per_question", "format_failure_rate"):
        assert key in nq
    assert set(nq["prompt_tokens_per_turn"]) >= {"p50", "p90", "p99", "mean", "max"}
    for r in records:
        assert r["trajectory"]["example"]["id"] == r["id"]
        assert r["turns"] == len(r["trajectory"]["turns"]) <= 2
        assert r["prompt_tokens"] == [t["prompt_tokens"] for t in r["trajectory"]["turns"]]
    assert "nq" in stdout and "EM" in stdout

    # a finished run resumes to a no-op; other settings are refused
    assert main(args) == 0
    assert read_predictions(predictions) == records
    assert main([*args, "--max-turns", "3"]) == 2


@pytest.mark.slow
def test_eval_in_process_and_report(
    tmp_path: Path, llm: HFModel, retriever: Retriever, capsys: pytest.CaptureFixture[str]
) -> None:
    examples = [QAExample(r["id"], r["question"], tuple(r["golden_answers"])) for r in ROWS[:2]]
    runs = []
    for agent in ("memsearcher", "react"):
        config = EvalConfig(agent, AgentConfig(max_turns=2, max_new_tokens=32, memory_tokens=32))
        out = tmp_path / agent
        summary = run_eval({"bamboogle": examples}, llm, retriever, config, out, progress=False)
        assert summary["datasets"]["bamboogle"]["questions"] == 2
        assert summary["settings"]["agent"] == agent
        runs.append(str(out))
    rows = load_rows(runs)
    assert [(r["run"], r["dataset"]) for r in rows] == [
        ("memsearcher", "bamboogle"),
        ("react", "bamboogle"),
    ]
    table = format_table(rows)
    assert "EM" in table.splitlines()[0] and "react" in table
    plots = tmp_path / "plots"
    assert main(["eval", "report", *runs, "--plots", str(plots)]) == 0
    assert "memsearcher" in capsys.readouterr().out
    assert (plots / "tokens_per_turn_bamboogle.png").stat().st_size > 1000
    assert main(["eval", "report", str(tmp_path / "nothing")]) == 2


def test_eval_needs_data_and_out(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--out", "x"]) == 2
    assert "--data" in capsys.readouterr().err


# -- bad records, concurrent runs --------------------------------------------------------------


def test_an_empty_eval_file_is_refused(tmp_path: Path) -> None:
    empty = write_jsonl(tmp_path / "nq" / "test.jsonl", [])
    with pytest.raises(MemSearcherError, match="holds no questions"):
        read_examples(empty)
    assert main(["eval", "--data", str(empty), "--out", str(tmp_path / "run")]) == 2
    assert not (tmp_path / "run").exists()


def test_a_question_with_a_lone_surrogate_is_read_as_text(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    # valid JSON; once decoded, not text that UTF-8 (or a tokenizer) can take
    path.write_text('{"id": "s", "question": "Who \\ud800 wrote Hamlet?", '
                    '"golden_answers": ["W\\udfffS"]}\n')  # fmt: skip
    (example,) = read_examples(path)
    assert example.question == "Who \ufffd wrote Hamlet?"
    assert example.golden_answers == ("W\ufffdS",)


def test_the_summary_counts_each_id_once(tmp_path: Path) -> None:
    """Two runs that wrote one file at once left some ids twice: the last line of each counts."""
    record = {"dataset": "nq", "question": "q", "golden_answers": ["a"], "prediction": "a",
              "end_reason": "answer", "turns": 1, "searches": 0, "prompt_tokens": [10],
              "trajectory": None}  # fmt: skip
    lines = [{**record, "id": f"q{i}", "em": 1.0, "f1": 1.0, "acc": 1.0} for i in range(4)]
    lines += [{**record, "id": "q0", "em": 0.0, "f1": 0.0, "acc": 0.0}]
    write_jsonl(tmp_path / "run" / "nq" / "predictions.jsonl", lines)
    examples = [QAExample(f"q{i}", "q", ("a",)) for i in range(4)]
    summary = run_eval({"nq": examples}, None, None, EvalConfig(), tmp_path / "run",  # type: ignore[arg-type]
                       progress=False)  # fmt: skip
    assert summary["datasets"]["nq"]["questions"] == 4
    assert summary["datasets"]["nq"]["em"] == 0.75


def test_a_run_in_progress_locks_its_folder(tmp_path: Path) -> None:
    from memsearcher.folders import exclusive

    out = tmp_path / "run"
    out.mkdir()
    examples = [QAExample("q0", "q", ("a",))]
    with exclusive(out / ".lock", "held"), pytest.raises(MemSearcherError, match="another eval"):
        run_eval({"nq": examples}, None, None, EvalConfig(), out, progress=False)  # type: ignore[arg-type]
    assert sorted(p.name for p in out.iterdir()) == [".lock"]  # nothing written
    (tmp_path / "file").write_text("x")
    with pytest.raises(MemSearcherError, match="is a file"):
        run_eval({"nq": examples}, None, None, EvalConfig(), tmp_path / "file")  # type: ignore[arg-type]


class FailsOn:
    """A real index that raises on queries holding ``word``: the fault a bad record causes
    (a fault injected by hand, since no real retriever here fails on a given query)."""

    def __init__(self, inner: Retriever, word: str) -> None:
        self.inner, self.word = inner, word

    def search(self, queries: Any, top_n: int) -> list[list[Any]]:
        if any(self.word in q for q in queries):
            raise RuntimeError(f"cannot search {self.word}")
        return self.inner.search(queries, top_n)


class AsyncScripted(ScriptedLLM):
    async def agenerate(self, prompt_ids: Any, params: SamplingParams) -> Any:
        return self.generate([prompt_ids], params)[0]


@pytest.mark.parametrize("driver", ["lockstep", "async"])
def test_a_failing_question_is_recorded_and_the_run_goes_on(
    tmp_path: Path, llm: HFModel, retriever: Retriever, driver: str
) -> None:
    scripted = AsyncScripted(llm.tokenizer, search_then_answer(searches=1, answer="Paris"))
    examples = [QAExample(f"q{i}", f"Question {i} BOOM" if i == 2 else f"Question {i}", ("Paris",))
                for i in range(6)]  # fmt: skip
    config = EvalConfig(agent_config=AgentConfig(max_turns=3), batch_size=4, driver=driver)
    out = tmp_path / "run"
    summary = run_eval({"nq": examples}, scripted, FailsOn(retriever, "BOOM"), config, out,
                       progress=False)  # fmt: skip
    records = {r["id"]: r for r in read_predictions(out / "nq" / "predictions.jsonl")}
    assert sorted(records) == [e.id for e in examples]
    assert records["q2"]["end_reason"] == "error" and "cannot search BOOM" in records["q2"]["error"]
    assert all(r["prediction"] == "Paris" for k, r in records.items() if k != "q2")
    assert summary["datasets"]["nq"]["end_reasons"] == {"answer": 5, "error": 1}
    # a rerun tries the failed question again, and only it
    summary = run_eval({"nq": examples}, scripted, retriever, config, out, progress=False)
    assert summary["datasets"]["nq"]["end_reasons"] == {"answer": 6}
    assert len(read_predictions(out / "nq" / "predictions.jsonl")) == 7


def test_many_failures_in_a_row_stop_the_run(
    tmp_path: Path, llm: HFModel, retriever: Retriever
) -> None:
    scripted = ScriptedLLM(llm.tokenizer, search_then_answer(searches=1, answer="Paris"))
    examples = [QAExample(f"q{i}", f"BOOM {i}", ("Paris",)) for i in range(30)]
    with pytest.raises(MemSearcherError, match="the last 10 questions all failed"):
        run_eval({"nq": examples}, scripted, FailsOn(retriever, "BOOM"),
                 EvalConfig(batch_size=4), tmp_path / "run", progress=False)  # fmt: skip
    assert len(read_predictions(tmp_path / "run" / "nq" / "predictions.jsonl")) == 10


def test_a_run_folder_with_the_flat_settings_of_older_versions_resumes(tmp_path: Path) -> None:
    """tests/fixtures/eval_run_flat was written by run_eval before EvalConfig nested its
    AgentConfig (settings.json flat: agent, max_turns, top_n, ...); it must still resume."""
    out = tmp_path / "run"
    shutil.copytree(Path(__file__).parent / "fixtures" / "eval_run_flat", out)
    saved = (out / "settings.json").read_text(encoding="utf-8")
    config = EvalConfig(agent_config=AgentConfig(max_turns=3, top_n=4, memory_tokens=64,
                                                 max_new_tokens=32))  # fmt: skip
    info = {"model": "embedded", "backend": "hf", "served_model": None,
            "retriever": "embedded", "templates": None}  # fmt: skip
    examples = [QAExample(f"q{i}", "q", ("a",)) for i in range(2)]
    summary = run_eval({"nq": examples}, None, None, config, out, None, info, progress=False)  # type: ignore[arg-type]
    assert summary["datasets"]["nq"]["questions"] == 2
    assert summary["datasets"]["nq"]["em"] == 0.5
    assert (out / "settings.json").read_text(encoding="utf-8") == saved
    other = EvalConfig(agent_config=AgentConfig(max_turns=4, top_n=4, memory_tokens=64,
                                                max_new_tokens=32))  # fmt: skip
    with pytest.raises(MemSearcherError, match="other settings \\(max_turns\\)"):
        run_eval({"nq": examples}, None, None, other, out, None, info, progress=False)  # type: ignore[arg-type]
    repeats = replace(config, agent_config=replace(config.agent_config, answer_on_repeat=True))
    with pytest.raises(MemSearcherError, match="other settings \\(answer_on_repeat\\)"):
        run_eval({"nq": examples}, None, None, repeats, out, None, info, progress=False)  # type: ignore[arg-type]
