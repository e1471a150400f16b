"""The veRL integration's parts that need no veRL: the data file, the rows, the config checks.

tests/test_verl.py drives the same code through veRL's own classes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from memsearcher.agent import AgentConfig, run_lockstep, start_episodes
from memsearcher.agent.replay import search_then_answer
from memsearcher.cli import main as cli
from memsearcher.data.compose import compose
from memsearcher.errors import MemSearcherError
from memsearcher.integrations.verl import (
    check_trainer_config,
    example_from_row,
    turn_rows,
    verl_rows,
    write_parquet,
)
from memsearcher.integrations.verl.outputs import finish_reason, lay_logprobs, reward_info
from memsearcher.llm.base import SamplingParams
from memsearcher.llm.hf import HFModel
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval.base import Retriever
from memsearcher.rl.rewards import multi_em_reward, multi_f1_reward, trajectory_reward
from memsearcher.types import QAExample, TokenSequence, Trajectory

ROWS = {
    "nq": [
        {"id": "n1", "question": "who wrote hamlet", "golden_answers": ["Shakespeare"]},
        {"id": "n2", "question": "capital of france", "golden_answers": ["Paris", "paris"]},
    ],
    "hotpotqa": [{"id": "h1", "question": "Which is older?", "golden_answers": ["Rome"]}],
}


def write_flashrag(folder: Path) -> Path:
    for name, rows in ROWS.items():
        split = "dev" if name == "hotpotqa" else "test"
        path = folder / name / f"{split}.jsonl"
        path.parent.mkdir(parents=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_prepare_writes_one_verl_row_per_question(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    data = write_flashrag(tmp_path / "flashrag")
    out = tmp_path / "train.parquet"
    argv = ["verl", "prepare", "--data", str(data), "--datasets", "nq,hotpotqa", "--agent", "react"]
    assert cli([*argv, "--out", str(out)]) == 0
    rows = pq.read_table(out).to_pylist()
    assert [r["data_source"] for r in rows] == ["nq", "nq", "hotpotqa"]
    assert {r["agent_name"] for r in rows} == {"react"}
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2]
    assert rows[1]["prompt"] == [{"role": "user", "content": "capital of france"}]
    assert rows[1]["reward_model"] == {
        "style": "rule",
        "ground_truth": {"target": ["Paris", "paris"]},
    }
    example = example_from_row(rows[1])
    assert example == QAExample(
        "n2", "capital of france", ("Paris", "paris"), {"data_source": "nq", "index": 1}
    )
    assert not list(tmp_path.glob("*.partial"))


def test_prepare_writes_a_row_per_shop_instruction(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--env shop``: the instructions of the generated shop's split, their target as the
    gold; the rows read back as the tasks the shop's episodes start from."""
    import pyarrow.parquet as pq

    from memsearcher.agent.environments.shop import instruction_example
    from memsearcher.agent.environments.shop_world import ShopConfig, generate_catalogue

    out = tmp_path / "shop.parquet"
    argv = ["verl", "prepare", "--env", "shop", "--shop-seed", "2", "--shop-families", "1"]
    assert cli([*argv, "--shop-split", "rl+test", "--agent", "mem1", "--out", str(out)]) == 0
    catalogue = generate_catalogue(ShopConfig(seed=2, families_per_category=1))
    tasks = [instruction_example(i) for s in ("rl", "test") for i in catalogue.split(s)]
    rows = pq.read_table(out).to_pylist()
    assert [r["data_source"] for r in rows] == ["shop"] * len(tasks)
    read = [example_from_row(row, needs_gold=False) for row in rows]
    assert [(e.id, e.question, e.golden_answers) for e in read] == [
        (t.id, t.question, t.golden_answers) for t in tasks
    ]
    assert cli([*argv, "--data", "q.jsonl", "--out", str(tmp_path / "x.parquet")]) == 2
    assert "--data is for --env search" in capsys.readouterr().err
    assert cli(["verl", "prepare", "--env", "webshop", "--out", str(tmp_path / "y.parquet")]) == 2
    assert "--env webshop needs --webshop-url" in capsys.readouterr().err
    row = {**rows[0], "extra_info": {**rows[0]["extra_info"], "golden_answers": []}}
    assert example_from_row(row, needs_gold=False).golden_answers == ()  # a WebShop session
    with pytest.raises(MemSearcherError, match="at least one golden answer"):
        example_from_row(row)


def test_prepare_writes_a_row_per_webshop_goal(tmp_path: Path) -> None:
    """``--env webshop``: the goals ``--sessions A:B`` (the first ``--limit``) of a server
    speaking WebShop's protocol (our shop, served), each its instruction and no gold."""
    import pyarrow.parquet as pq
    from _servers import shop_server

    from memsearcher.agent.environments.shop_world import ShopConfig, generate_catalogue

    test = generate_catalogue(ShopConfig(seed=2, families_per_category=1)).split("test")
    out = tmp_path / "webshop.parquet"
    with shop_server(2, 1, "test", tmp_path / "shop.log") as url:
        argv = ["verl", "prepare", "--env", "webshop", "--webshop-url", url, "--limit", "2"]
        assert cli([*argv, "--sessions", "1:4", "--agent", "react", "--out", str(out)]) == 0
    read = [example_from_row(r, needs_gold=False) for r in pq.read_table(out).to_pylist()]
    assert [(e.id, e.question, e.golden_answers) for e in read] == [
        ("fixed_1", test[1].text, ()),
        ("fixed_2", test[2].text, ()),
    ]


def test_prepare_rejects_an_unknown_agent(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_flashrag(tmp_path / "flashrag")
    argv = ["verl", "prepare", "--data", str(data), "--agent", "nope", "--out", str(tmp_path / "x")]
    assert cli(argv) == 2
    assert "--agent 'nope': choose one of" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_prepare_never_replaces_its_input_a_folder_or_a_file_unasked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "nq.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS["nq"]))
    kept = data.read_bytes()
    prepare = ["verl", "prepare", "--data", str(data), "--out"]
    assert cli([*prepare, str(data)]) == 2
    assert f"--out {data} is the input --data" in capsys.readouterr().err
    assert cli([*prepare, str(data), "--overwrite"]) == 2
    assert data.read_bytes() == kept
    folder = write_flashrag(tmp_path / "flashrag")
    assert cli([*prepare, str(folder / "nq" / "new.parquet"), "--data", str(folder)]) == 2
    assert "inside the input --data" in capsys.readouterr().err
    assert cli([*prepare, str(folder)]) == 2
    assert f"--out {folder} is a folder; name the file to write" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.partial")) and not (folder / "nq" / "new.parquet").exists()

    out = tmp_path / "train.parquet"
    assert cli([*prepare, str(out)]) == 0
    assert cli([*prepare, str(out)]) == 2
    assert f"{out} exists; choose another --out or pass --overwrite" in capsys.readouterr().err
    assert cli([*prepare, str(out), "--overwrite"]) == 0


def test_rows_read_back_as_verl_hands_them_over() -> None:
    # veRL's dataset turns parquet lists into NumPy arrays
    row = {
        "data_source": "nq",
        "extra_info": {"id": 7, "question": " q? ", "golden_answers": np.array(["a", "b"])},
    }
    assert example_from_row(row).golden_answers == ("a", "b")
    assert example_from_row(row).question == "q?"
    with pytest.raises(MemSearcherError, match="no 'extra_info'"):
        example_from_row({"prompt": []})
    with pytest.raises(MemSearcherError, match="lacks golden_answers"):
        example_from_row({"extra_info": {"question": "q"}})
    with pytest.raises(MemSearcherError, match="at least one golden answer"):
        example_from_row({"extra_info": {"question": "q", "golden_answers": []}})
    lost = {"question": "q", "golden_answers": ["a; b"], "objectives": [{"question": "x"}]}
    with pytest.raises(MemSearcherError, match="an objective without golden answers"):
        example_from_row({"extra_info": lost})


def _numpy_lists(value: Any) -> Any:
    """``value`` with every list an object array, as veRL's dataset hands parquet lists over."""
    if isinstance(value, dict):
        return {key: _numpy_lists(item) for key, item in value.items()}
    if isinstance(value, list):
        array = np.empty(len(value), dtype=object)
        array[:] = [_numpy_lists(item) for item in value]
        return array
    return value


MULTI = [
    QAExample("a", "Who wrote Hamlet", ("William Shakespeare", "Shakespeare")),
    QAExample("b", "What is the capital of France?", ("Paris",)),
    QAExample("c", "Which planet is red?", ("Mars", "the red planet")),
]


@pytest.mark.parametrize("objectives", [1, 2, 3])
def test_a_multi_objective_task_scores_the_same_through_the_rows(
    objectives: int, tmp_path: Path
) -> None:
    """Every objective's golds survive verl_rows -> parquet -> example_from_row, read back as
    lists or as veRL's NumPy arrays: a perfect answer, or one with another gold of an objective,
    scores as it does directly, and so do the validation metrics."""
    import pyarrow.parquet as pq

    tasks = compose(MULTI, objectives, seed=0)
    out = write_parquet(verl_rows({"nq": tasks}, "mem1", "train"), tmp_path / "t.parquet")
    listed = pq.read_table(out).to_pylist()
    for rows in (listed, [_numpy_lists(row) for row in listed]):
        for task, row in zip(tasks, rows, strict=True):
            back = example_from_row(row)
            assert back.objectives == task.objectives
            assert back.question == task.question
            perfect = "; ".join(golds[-1] for golds in task.objectives)
            for answer in (perfect, "Paris", None):
                direct, through = _trajectory((), answer, task), _trajectory((), answer, back)
                for reward in (multi_em_reward, multi_f1_reward):
                    assert reward(through) == reward(direct)
                assert reward_info(through, 0.0) == reward_info(direct, 0.0)
            assert multi_em_reward(_trajectory((), perfect, back)) == objectives
            assert reward_info(_trajectory((), perfect, back), 0.0)["acc"] == objectives


def _trajectory(
    sequences: tuple[TokenSequence, ...],
    answer: str | None = "Paris",
    example: QAExample | None = None,
) -> Trajectory:
    return Trajectory(
        example=example or QAExample("q", "Which city?", ("Paris",)),
        agent="memsearcher",
        turns=(),
        sequences=sequences,
        end_reason="answer" if answer else "format_error",
        answer=answer,
    )


def test_logprobs_land_on_generated_tokens_in_order() -> None:
    trajectory = _trajectory(
        (TokenSequence((1, 2), (5, 6, 7, 8), (1, 0, 0, 1)), TokenSequence((3,), (9, 10), (1, 1)))
    )
    rows = lay_logprobs(trajectory, [[-0.1], [-0.2], [-0.3, -0.4]])
    assert rows == [[-0.1, 0.0, 0.0, -0.2], [-0.3, -0.4]]
    with pytest.raises(
        MemSearcherError, match="4 generated tokens but the server returned log-probs for 3"
    ):
        lay_logprobs(trajectory, [[-0.1], [-0.2, -0.3]])


def test_rows_of_a_real_trajectory(llm: HFModel, retriever: Retriever) -> None:
    """A two-search MemSearcher trajectory: three rows, the episode's own tokens and masks,
    the graded reward and its metrics on the last row only."""
    scripted = ScriptedLLM(llm.tokenizer, search_then_answer(2, "Paris", memory_words=10))
    episodes = start_episodes(
        "memsearcher", [QAExample("q", "Which city?", ("Paris",))], llm.tokenizer,
        AgentConfig(max_turns=3, memory_tokens=64, max_new_tokens=64),
    )  # fmt: skip
    (trajectory,) = run_lockstep(episodes, scripted, retriever, SamplingParams())
    generated = sum(sum(s.loss_mask) for s in trajectory.sequences)
    rows = turn_rows(trajectory, [[-1.0] * generated], trajectory_reward, {"max_global_steps": 3})
    assert len(rows) == len(trajectory.sequences) == 3
    for row, sequence in zip(rows, trajectory.sequences, strict=True):
        assert row["prompt_ids"] == list(sequence.prompt_ids)
        assert row["response_ids"] == list(sequence.response_ids)
        assert row["response_mask"] == list(sequence.loss_mask)
        assert row["response_logprobs"] == [-1.0 if m else 0.0 for m in sequence.loss_mask]
        assert row["num_turns"] == 3
        assert row["extra_fields"]["max_global_steps"] == 3
        assert row["extra_fields"]["memsearcher"]["prompt_tokens"] == [
            t.prompt_tokens for t in trajectory.turns
        ]
    assert 0 in rows[0]["response_mask"]  # the tool response
    assert "reward_score" not in rows[0] and "reward_extra_info" not in rows[0]["extra_fields"]
    assert rows[-1]["reward_score"] == 1.0
    info = rows[-1]["extra_fields"]["reward_extra_info"]
    assert info == reward_info(trajectory, 1.0)
    assert (info["acc"], info["turns"], info["searches"], info["pred"]) == (1.0, 3.0, 2.0, "Paris")


def test_no_logprobs_and_no_rows() -> None:
    trajectory = _trajectory((TokenSequence((1,), (2,), (1,)),), answer=None)
    (row,) = turn_rows(trajectory, None, trajectory_reward)
    assert "response_logprobs" not in row and row["reward_score"] == 0.0
    with pytest.raises(MemSearcherError, match="ended before the model generated anything"):
        turn_rows(_trajectory(()), None, trajectory_reward)


def test_finish_reason_read_from_the_tokens(llm: HFModel) -> None:
    tokenizer = llm.tokenizer
    eos = min(tokenizer.eos_token_ids)
    call = tokenizer.encode("<think> a </think><tool_call>{}</tool_call>")
    assert finish_reason([*tokenizer.encode("ok"), eos], ("</tool_call>",), tokenizer) == "stop"
    assert finish_reason(call, ("</tool_call>",), tokenizer) == "stop"
    assert finish_reason(call[:-3], ("</tool_call>",), tokenizer) == "length"
    assert finish_reason(call, (), tokenizer) == "length"


def _config(estimator: str = "grpo", use_v1: bool = True, kl_in_reward: bool = False) -> dict:
    return {
        "algorithm": {"adv_estimator": estimator, "use_kl_in_reward": kl_in_reward},
        "trainer": {"use_v1": use_v1},
    }


def test_config_checks() -> None:
    check_trainer_config(_config())  # the supported setup passes
    with pytest.raises(MemSearcherError, match="counts N times") as caught:
        check_trainer_config(_config("rloo", use_v1=False, kl_in_reward=True))
    message = str(caught.value)
    assert "adv_estimator=rloo" in message and "use_v1=false" in message
    assert "use_kl_in_reward=true" in message
    with pytest.raises(MemSearcherError, match="adv_estimator=gae"):
        check_trainer_config({"trainer": {"use_v1": True}})  # veRL's default estimator
