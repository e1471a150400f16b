"""``memsearcher eval --env shop``: the shop's instructions through eval's run folder, scored by
the shop's reward.

The summary's shop metrics are checked by hand on made-up records; a whole run on the real
shop with a scripted model playing the oracle for some instructions and buying hastily for
the others (the agents' protocol on the real tokenizer: `ScriptedLLM`, since no small model
here shops); and the real CLI on the tiny real Llama of `tiny_model.py`, which never writes an
action (reward 0), then resumes from its folder.

``eval --env webshop``: the same shop served over WebShop's HTTP protocol by the real server
(``shop_server``, a subprocess on 127.0.0.1), the scripted run giving the same records as
locally, and the CLI on the tiny Llama.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _policies import follow_plans
from _servers import free_port, shop_server
from _wrappers import OnePromptAtATime
from tiny_model import save_tiny_model
from transformers import AutoTokenizer

from memsearcher.agent import AgentConfig
from memsearcher.agent.environments import ShopAction
from memsearcher.agent.environments.shop import (
    ShopEnv,
    ShopEnvironment,
    ShopSearch,
    instruction_example,
    solve,
)
from memsearcher.agent.environments.shop_world import Catalogue, ShopConfig, generate_catalogue
from memsearcher.agent.environments.webshop_client import WebShopEnvironment, fixed_sessions
from memsearcher.cli import main
from memsearcher.errors import MemSearcherError
from memsearcher.eval.predictions import read_predictions
from memsearcher.eval.report import format_table, load_rows
from memsearcher.eval.run import EvalConfig, run_eval, shop_summary
from memsearcher.llm.hf import HFModel
from memsearcher.llm.scripted import Reply, ScriptedLLM


def record(reward: float | None, prompt_tokens: list[int]) -> dict[str, Any]:
    return {"reward": reward, "prompt_tokens": prompt_tokens, "turns": len(prompt_tokens)}


def test_shop_summary_by_hand() -> None:
    records = [
        record(1.0, [300, 700, 400, 400, 400]),
        record(0.5, [300, 700, 400, 400, 400, 400, 400, 400, 400]),  # 9 steps: a long one
        record(None, [300]),  # a format error: no reward from the shop
        record(0.0, []),  # an error record: no turn at all
    ]
    assert shop_summary(records) == {
        "mean_reward": 1.5 / 4,
        "success_rate": 0.25,
        "mean_steps": (5 + 9 + 1 + 0) / 4,
        "peak_prompt_tokens": {"mean": (700 + 700 + 300 + 0) / 4, "max": 700.0},
        "long_episodes": 1,
        "peak_prompt_tokens_long": {"mean": 700.0, "max": 700.0},
    }
    assert shop_summary(records[2:])["peak_prompt_tokens_long"] is None


SHOP = ShopConfig(seed=0, families_per_category=1)
"""The shop of the scripted runs, locally and served over HTTP."""


def shopper(catalogue: Catalogue) -> tuple[dict[str, list[str]], Reply]:
    """Each test instruction's plan, and a reply function that plays it (`follow_plans`):
    the oracle's actions on the even instructions, on the odd ones the same without choosing
    the options (a partial reward)."""
    search = ShopSearch(catalogue.products)
    plans = {}
    for i, instruction in enumerate(catalogue.split("test")):
        plan = solve(ShopEnv(catalogue, search, instruction))
        if i % 2:
            options = {f"click[{v}]" for v in instruction.goal.options.values()}
            plan = [a for a in plan if a not in options]
        plans[instruction.text] = plan
    return plans, follow_plans(plans)


def test_eval_on_the_shop_scores_the_shops_reward(llm: HFModel, tmp_path: Path) -> None:
    catalogue = generate_catalogue(SHOP)
    test = catalogue.split("test")
    plans, reply = shopper(catalogue)
    model = ScriptedLLM(llm.tokenizer, reply)
    config = EvalConfig(agent_config=AgentConfig(max_turns=15), environment="shop")
    examples = [instruction_example(i) for i in test]
    environment = ShopEnvironment(catalogue, ShopSearch(catalogue.products))
    out = tmp_path / "run"
    summary = run_eval({"shop-test": examples}, model, environment, config, out, progress=False)
    records = read_predictions(out / "shop-test" / "predictions.jsonl")
    rewards = [r["reward"] for r in records]
    assert rewards[0::2] == [1.0] * len(rewards[0::2]) and all(0 < r < 1 for r in rewards[1::2])
    assert [r["em"] for r in records] == [1.0] * len(records)  # the right product every time
    shop = summary["datasets"]["shop-test"]["shop"]
    assert shop["mean_reward"] == pytest.approx(sum(rewards) / len(rewards))
    assert shop["success_rate"] == 0.5
    assert shop["mean_steps"] == pytest.approx(sum(len(p) for p in plans.values()) / len(test))
    assert summary["settings"]["environment"] == "shop"
    assert json.loads((out / "summary.json").read_text()) == summary
    header, _, row = format_table(load_rows([out])).splitlines()  # eval report's table
    assert header.split()[-2:] == ["reward", "success"]
    assert row.split()[-2:] == [f"{shop['mean_reward']:.3f}", "50.0%"]
    search_row = {k: v for k, v in load_rows([out])[0].items() if k not in ("reward", "success")}
    assert "reward" not in format_table([search_row])  # a search run's table has no such column


def test_eval_cli_on_the_shop_with_a_real_model_then_resume(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = save_tiny_model(tmp_path / "tiny")
    out = tmp_path / "run"
    templates = tmp_path / "shop.yaml"
    templates.write_text('mem1_user: "Buy it. Start page: {page}"\n')
    args = ["eval", "--env", "shop", "--shop-seed", "1", "--shop-families", "1"]
    args += ["--split", "test", "--agent", "mem1", "--model", str(tiny), "--device", "cpu"]
    args += ["--out", str(out), "--max-new-tokens", "8", "--no-progress"]
    assert main([*args, "--templates", str(templates)]) == 0
    assert "shop-test: 4 instructions, reward 0.0000, success 0.0000" in capsys.readouterr().out
    records = read_predictions(out / "shop-test" / "predictions.jsonl")
    assert len(records) == 4
    assert all(
        r["reward"] == 0.0 and r["end_reason"] in ("format_error", "length") for r in records
    )
    decode = AutoTokenizer.from_pretrained(tiny).decode
    prompt = decode(records[0]["trajectory"]["sequences"][0]["prompt_ids"])
    assert "Buy it. Start page: WebShop" in prompt  # the shop's prompt from --templates
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["shop"] == {"seed": 1, "families_per_category": 1, "split": "test"}
    assert main([*args, "--templates", str(templates)]) == 0  # resumed: nothing left to run
    assert len(read_predictions(out / "shop-test" / "predictions.jsonl")) == 4
    assert main(args) == 2  # other prompts into the same folder
    assert "other settings (templates)" in capsys.readouterr().err
    assert main([*args[:6], "2", *args[7:], "--templates", str(templates)]) == 2  # another shop
    assert "other settings (shop.families_per_category)" in capsys.readouterr().err


def test_eval_on_the_shop_refuses_what_it_cannot_use(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["eval", "--env", "shop", "--out", "x", "--data", "d.jsonl"]) == 2
    assert "takes no --data" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown environment"):
        EvalConfig(environment="web")
    assert main(["eval", "--env", "shop"]) == 2
    assert "needs --out" in capsys.readouterr().err


@pytest.fixture(scope="module")
def webshop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`SHOP`'s test instructions served over WebShop's HTTP protocol, as fixed_0, fixed_1..."""
    log = tmp_path_factory.mktemp("log") / "shop.log"
    with shop_server(SHOP.seed, SHOP.families_per_category, "test", log) as url:
        yield url


def test_eval_over_http_gives_the_local_shops_records(
    llm: HFModel, webshop: str, tmp_path: Path
) -> None:
    """The scripted shopper on the test instructions, in the local shop and in the same shop
    served over HTTP: each episode takes the same steps, sees the same contexts and earns the
    same reward. The server does not show the target, so over HTTP EM is 0."""
    catalogue = generate_catalogue(SHOP)
    test = catalogue.split("test")
    _, reply = shopper(catalogue)
    model = ScriptedLLM(llm.tokenizer, reply)
    config = EvalConfig(agent_config=AgentConfig(max_turns=15), environment="shop")
    local = [instruction_example(i) for i in test]
    shop = ShopEnvironment(catalogue, ShopSearch(catalogue.products))
    run_eval({"shop": local}, model, shop, config, tmp_path / "local", progress=False)
    with WebShopEnvironment(webshop) as environment:
        remote = environment.examples(fixed_sessions(0, len(test)))
        assert [e.question for e in remote] == [i.text for i in test]
        config = EvalConfig(agent_config=AgentConfig(max_turns=15), environment="webshop")
        summary = run_eval(
            {"webshop": remote}, model, environment, config, tmp_path / "http", progress=False
        )
        assert environment.sessions == {}  # every episode's env dropped at its end
    mine = read_predictions(tmp_path / "local" / "shop" / "predictions.jsonl")
    theirs = read_predictions(tmp_path / "http" / "webshop" / "predictions.jsonl")
    same = ("reward", "turns", "end_reason", "prompt_tokens", "prediction")
    for a, b in zip(mine, theirs, strict=True):
        assert {k: a[k] for k in same} == {k: b[k] for k in same}
        assert (a["em"], b["em"]) == (1.0, 0.0) and b["id"].startswith("fixed_")
        sequences = zip(a["trajectory"]["sequences"], b["trajectory"]["sequences"], strict=True)
        assert all(x["prompt_ids"] == y["prompt_ids"] for x, y in sequences)
    rewards = [r["reward"] for r in theirs]
    assert 1.0 in rewards and any(0 < r < 1 for r in rewards)
    assert summary["datasets"]["webshop"]["shop"]["mean_reward"] == pytest.approx(
        sum(rewards) / len(rewards)
    )


def test_eval_cli_on_a_webshop_server_then_resume(
    webshop: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = save_tiny_model(tmp_path / "tiny")
    out = tmp_path / "run"
    args = ["eval", "--env", "webshop", "--webshop-url", webshop, "--sessions", "1:3"]
    args += ["--model", str(tiny), "--device", "cpu", "--out", str(out), "--no-progress"]
    args += ["--max-new-tokens", "8"]
    assert main(args) == 0
    assert "webshop: 2 instructions, reward 0.0000" in capsys.readouterr().out
    records = read_predictions(out / "webshop" / "predictions.jsonl")
    test = generate_catalogue(SHOP).split("test")
    assert [r["id"] for r in records] == ["fixed_1", "fixed_2"]
    assert [r["question"] for r in records] == [test[1].text, test[2].text]
    assert all(r["reward"] == 0.0 for r in records)  # the tiny model writes no action
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["webshop"] == {"url": webshop, "sessions": "1:3"}
    assert main(args) == 0  # resumed: nothing left to run
    assert len(read_predictions(out / "webshop" / "predictions.jsonl")) == 2
    other = [*args[:6], "0:3", *args[7:]]
    assert main(other) == 2  # other sessions into the same folder
    assert "other settings (webshop.sessions)" in capsys.readouterr().err


def test_eval_on_a_webshop_server_refuses_what_it_cannot_reach(
    webshop: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["eval", "--env", "webshop", "--out", str(tmp_path / "run")]
    assert main(base) == 2
    assert "needs --webshop-url" in capsys.readouterr().err
    assert main([*base, "--webshop-url", webshop, "--sessions", "0:99"]) == 2
    assert "session fixed_" in capsys.readouterr().err  # the shop serves fewer
    assert main([*base, "--webshop-url", webshop, "--sessions", "3:1"]) == 2
    assert "give A:B" in capsys.readouterr().err
    nobody = f"http://127.0.0.1:{free_port()}"
    assert main([*base, "--webshop-url", nobody, "--sessions", "0:1"]) == 2
    assert "cannot reach" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing written before the run could start
    with WebShopEnvironment(webshop) as environment:
        (refused,) = environment.act([ShopAction("fixed_999", "")])
        assert isinstance(refused, MemSearcherError) and "404" in str(refused)


def test_a_task_of_another_shop_stops_the_run() -> None:
    """An instruction the shop does not have means the tasks came from another shop (another
    seed or size): every episode would end at once with reward 0, so it raises."""
    catalogue = generate_catalogue(SHOP)
    shop = ShopEnvironment(catalogue, ShopSearch(catalogue.products))
    (page,) = shop.act([ShopAction(f"{catalogue.split('test')[0].id}#0", "")])  # the control
    assert "Instruction:" in page.text
    with pytest.raises(MemSearcherError, match="no instruction 'test-999' in this shop"):
        shop.act([ShopAction("test-999#0", "")])


def test_the_async_driver_shops_as_lockstep_locally_and_over_http(
    llm: HFModel, webshop: str, tmp_path: Path
) -> None:
    """eval's async driver, four episodes in flight and the model awaited one prompt at a
    time, gives each instruction the record the lockstep driver gives, in the local shop and
    on the served one."""
    catalogue = generate_catalogue(SHOP)
    test = catalogue.split("test")
    _, reply = shopper(catalogue)
    backend = OnePromptAtATime(ScriptedLLM(llm.tokenizer, reply))
    local = [instruction_example(i) for i in test]
    same = ("reward", "turns", "end_reason", "prompt_tokens", "prediction")
    records = {}
    with WebShopEnvironment(webshop) as served:
        served_tasks = served.examples(fixed_sessions(0, len(test)))
        for env, driver in (("shop", "lockstep"), ("shop", "async"), ("webshop", "async")):
            config = EvalConfig(
                agent_config=AgentConfig(max_turns=15), environment=env, driver=driver,
                concurrency=4,
            )  # fmt: skip
            shop = ShopEnvironment(catalogue, ShopSearch(catalogue.products))
            environment = served if env == "webshop" else shop
            tasks = served_tasks if env == "webshop" else local
            out = tmp_path / f"{env}-{driver}"
            run_eval({"test": tasks}, backend, environment, config, out, progress=False)
            lines = read_predictions(out / "test" / "predictions.jsonl")
            records[env, driver] = {r["question"]: {k: r[k] for k in same} for r in lines}
    assert backend.most_in_flight > 1
    assert len(records["shop", "lockstep"]) == len(test)
    assert records["shop", "async"] == records["shop", "lockstep"]
    assert records["webshop", "async"] == records["shop", "lockstep"]
