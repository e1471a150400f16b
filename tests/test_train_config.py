"""Training configs (YAML plus overrides) and the FlashRAG question reader."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from memsearcher.agent import AgentConfig
from memsearcher.data.flashrag import read_examples
from memsearcher.demo.pipeline import DemoConfig
from memsearcher.errors import MemSearcherError
from memsearcher.rl.config import GRPOConfig, SFTConfig, config_to_dict, load_config
from memsearcher.teach.config import ProtocolDataConfig

PRESETS = Path(__file__).parent.parent / "configs"


def test_overrides_apply_on_top_of_the_file(tmp_path: Path) -> None:
    preset = tmp_path / "c.yaml"
    preset.write_text("group_size: 4\noptim:\n  lr: 1e-5\nagent:\n  max_turns: 3\n")
    config = load_config(GRPOConfig, preset, ["group_size=2", "model.lora_targets=[q_proj]"])
    assert config.group_size == 2
    assert config.optim.lr == 1e-5
    assert config.agent.max_turns == 3
    assert config.model.lora_targets == ("q_proj",)
    assert load_config(GRPOConfig, None, config_to_dict_overrides(config)) == config


def config_to_dict_overrides(config: GRPOConfig) -> list[str]:
    import json

    flat: list[str] = []

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}{key}.", inner)
        else:
            flat.append(f"{prefix[:-1]}={json.dumps(value)}")

    walk("", config_to_dict(config))
    return flat


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.lrr=1", "unknown config key optim.lrr; valid keys: optim.lr,"),
        ("group_sise=1", "valid keys: data, output_dir"),
        ("group_size=many", "group_size must be int"),
        ("group_size", "is not key=value"),
        ("agent.max_turns=0", "max_turns must be an integer in"),
        ("mini_batch_questions=3", "must be a multiple of mini_batch_questions"),
        ("optim=3", "optim must be a section"),
    ],
)
def test_bad_overrides_say_what_is_valid(override: str, message: str) -> None:
    with pytest.raises(MemSearcherError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_config(GRPOConfig, None, [override])


@pytest.mark.parametrize("preset", sorted(PRESETS.glob("*.yaml")), ids=lambda p: p.name)
def test_presets_load(preset: Path) -> None:
    from memsearcher.recipe.config import RecipeConfig

    recipes: dict[str, type] = {"embedded-agent.yaml": RecipeConfig}
    cls = recipes.get(preset.name, SFTConfig if preset.name.startswith("sft") else GRPOConfig)
    load_config(cls, preset)


def test_paper_preset_has_the_reference_hyper_parameters() -> None:
    config = load_config(GRPOConfig, PRESETS / "grpo-qwen2.5-3b.yaml")
    assert (config.optim.lr, config.questions_per_step, config.mini_batch_questions) == (
        1e-6,
        256,
        128,
    )
    assert (config.group_size, config.beta, config.clip_low, config.temperature) == (
        5,
        0.001,
        0.2,
        1.0,
    )
    assert (config.agent.max_new_tokens, config.agent.max_turns) == (512, 5)
    assert config.agent.memory_tokens == 1024


def test_training_questions_read_as_flashrag(tmp_path: Path) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text(
        '{"id": 1, "question": "Who?", "golden_answers": ["X", "B"], "metadata": {"s": 1}}\n\n'
        '{"id": "2", "question": "What?", "golden_answers": "C"}\n'
    )
    first, second = read_examples(path)
    assert (first.id, first.golden_answers, first.metadata) == ("1", ("X", "B"), {"s": 1})
    assert second.golden_answers == ("C",)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "q.jsonl:1: not valid JSON"),
        ('{"id": "1", "question": "Q"}', "q.jsonl:1: a FlashRAG row needs"),
        ('{"id": "1", "question": "Q", "golden_answers": 1}', "golden_answers' must be"),
        ("[1]", "q.jsonl:1: a FlashRAG row needs"),
    ],
)
def test_question_errors_name_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "q.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(MemSearcherError, match=message):
        read_examples(path)


def test_draw_is_a_pure_function_of_position() -> None:
    from memsearcher.rl.seeding import draw

    whole = draw(5, 0, 12, seed=3)
    assert sorted(whole[:5]) == list(range(5)) and sorted(whole[5:10]) == list(range(5))
    assert draw(5, 3, 4, seed=3) == whole[3:7]  # a resumed run sees the same order
    assert draw(5, 0, 5, seed=4) != whole[:5]


def test_schedules_warm_up_then_follow_their_shape() -> None:
    import torch

    from memsearcher.rl.config import OptimConfig
    from memsearcher.rl.optim import make_scheduler

    def lrs(schedule: str) -> list[float]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        config = OptimConfig(lr=1.0, warmup_steps=2, schedule=schedule)
        scheduler = make_scheduler(optimizer, config, total_updates=6)
        out = []
        for _ in range(6):
            out.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
        return out

    assert lrs("constant") == pytest.approx([0.5, 1, 1, 1, 1, 1])
    assert lrs("cosine") == pytest.approx([0.5, 1, 1, 0.8535534, 0.5, 0.1464466])
    with pytest.raises(ValueError, match=r"schedule must be one of \['constant', 'cosine'\]"):
        lrs("linear")  # the config refuses it before any scheduler is made


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["top_p=0.9"], "top_p=0.9: GRPO samples from softmax"),
        (["model.dtype=bfloat16"], "model.dtype=bfloat16 with optim.lr=1e-06"),
        (["model.dtype=float16", "optim.lr=5e-5"], "Keep model.dtype=float32"),
        (["model.dtype=auto"], "model.dtype must be one of"),
        # LoRA is the policy's only: the critic loads in model.dtype and trains every weight
        (
            ["model.dtype=bfloat16", "model.lora_rank=8", "advantage=gae"],
            "model.dtype=bfloat16 with advantage=gae and critic.lr=1e-05",
        ),
    ],
)
def test_precision_and_sampling_that_cannot_train_are_refused(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(MemSearcherError, match=message.replace("(", r"\(")):
        load_config(GRPOConfig, None, overrides)


def test_bfloat16_weights_are_accepted_where_they_train() -> None:
    """LoRA keeps its adapters in float32 over a frozen bfloat16 base; a large lr moves
    bfloat16 weights."""
    load_config(GRPOConfig, None, ["model.dtype=bfloat16", "model.lora_rank=8"])
    critic = ["advantage=gae", "critic.lr=1e-3"]
    load_config(GRPOConfig, None, ["model.dtype=bfloat16", "model.lora_rank=8", *critic])
    load_config(SFTConfig, None, ["model.dtype=bfloat16", "optim.lr=1e-3"])


def test_the_default_precision_is_float32_weights_under_autocast() -> None:
    """On a GPU the defaults give float32 master weights and bfloat16 forward passes; the old
    default, bfloat16 weights, rounds every lr 1e-6 AdamW step away (next test)."""
    import torch

    from memsearcher.rl.policy import resolve_precision

    model = GRPOConfig().model
    assert (model.dtype, model.autocast) == ("float32", "auto")
    cpu = resolve_precision(model, "cpu")
    assert (cpu.weights, cpu.compute) == (torch.float32, None)


def test_adamw_at_lr_1e6_moves_float32_weights_and_not_bfloat16_ones() -> None:
    """Why bfloat16 trainable weights are refused: 100 AdamW steps at lr 1e-6 leave bfloat16
    weights of 0.02 / 0.005 / -0.03 exactly where they were, and move float32 ones."""
    import torch

    def train(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        weight = torch.nn.Parameter(torch.tensor([0.02, 0.005, -0.03], dtype=dtype))
        start = weight.detach().clone()
        optimizer = torch.optim.AdamW([weight], lr=1e-6, weight_decay=0.0)
        for _ in range(100):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = (weight * torch.tensor([1.0, -1.0, 1.0])).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        return start, weight.detach()

    start, end = train(torch.bfloat16)
    assert torch.equal(start, end)
    start, end = train(torch.float32)
    assert torch.all((start - end).abs() > 5e-5)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.lr=-1", "optim.lr must be a finite number > 0, got -1.0"),
        ("optim.lr=nan", "optim.lr must be a finite number > 0, got nan"),
        ("optim.lr=.inf", "optim.lr must be a finite number > 0, got inf"),
        ("optim.lr=0", "optim.lr must be a finite number > 0"),
        ("optim.weight_decay=-0.1", "optim.weight_decay must be a finite number >= 0"),
        ("optim.betas=[0.9,1.0]", "optim.betas must be two numbers in [0, 1)"),
        ("optim.warmup_steps=-1", "optim.warmup_steps must be >= 0"),
        ("optim.schedule=linear", "optim.schedule must be one of ['constant', 'cosine']"),
        ("optim.max_grad_norm=nan", "optim.max_grad_norm must be a finite number >= 0"),
        ("beta=-1", "beta must be a finite number >= 0"),
        ("beta=nan", "beta must be a finite number >= 0"),
        ("agent_name=mem0", "agent_name must be one of ['mem1', 'memsearcher', 'react']"),
        ("reward=accuracy", "reward must be one of ['em', 'environment', 'f1', 'graded'"),
        ("aggregation=sum", "aggregation must be one of"),
        ("clip_low=1", "clip_low must be in [0, 1)"),
        ("clip_high=-0.2", "clip_high must be a finite number >= 0"),
        ("temperature=nan", "temperature must be a finite number"),
        ("steps=-5", "steps must be >= 0"),
        ("seed=-1", "seed must be >= 0"),
        ("model.lora_rank=-8", "model.lora_rank must be >= 0"),
        ("model.distributed=zero3", "model.distributed must be ddp or fsdp"),
    ],
)
def test_values_out_of_range_fail_at_load_naming_the_key(override: str, message: str) -> None:
    with pytest.raises(MemSearcherError, match=re.escape(f"invalid config: {message}")):
        load_config(GRPOConfig, None, [override])


def test_print_config_refuses_a_bad_config(capsys: pytest.CaptureFixture[str]) -> None:
    from memsearcher.cli import main

    assert main(["train", "grpo", "--print-config", "optim.lr=nan"]) == 2
    assert "optim.lr must be a finite number > 0, got nan" in capsys.readouterr().err
    assert main(["train", "sft", "--print-config", "optim.lr=-1e-5"]) == 2
    assert "optim.lr must be" in capsys.readouterr().err
    assert main(["train", "grpo", "--print-config", "optim.lr=2e-6"]) == 0


@pytest.mark.parametrize(
    ("cls", "override", "message"),
    [
        (GRPOConfig, "group_size=1", "group_size must be >= 2 with advantage: grpo"),
        (GRPOConfig, f"agent.max_turns={10**30}", r"max_turns must be an integer in \[1, 1000"),
        (GRPOConfig, f"micro_batch_tokens={10**26}", r"micro_batch_tokens must be an integer in"),
        (SFTConfig, f"micro_batch_tokens={10**26}", r"micro_batch_tokens must be an integer in"),
        # an inference option: training would drop the repeated query unscored
        (GRPOConfig, "agent.answer_on_repeat=true", "agent.answer_on_repeat is for inference"),
        (DemoConfig, "agent.answer_on_repeat=true", "agent.answer_on_repeat is for inference"),
        (ProtocolDataConfig, "agent.answer_on_repeat=true", "answer_on_repeat is for inference"),
    ],
)  # fmt: skip
def test_values_that_cannot_work_are_refused(cls: type, override: str, message: str) -> None:
    with pytest.raises(MemSearcherError, match=message):
        load_config(cls, None, [override])


def test_floats_are_not_counts_even_from_python() -> None:
    with pytest.raises(ValueError, match="max_turns must be an integer"):
        AgentConfig(max_turns=1e30)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="micro_batch_tokens must be an integer"):
        GRPOConfig(micro_batch_tokens=1e26)  # type: ignore[arg-type]


def test_a_critic_needs_no_group() -> None:
    config = load_config(GRPOConfig, PRESETS / "ppo-mem1.yaml")
    assert (config.advantage, config.group_size) == ("gae", 1)


SHOP = ["environment=shop", "reward=environment"]
WEBSHOP = ["environment=webshop", "reward=environment", "webshop_url=http://127.0.0.1:3000"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["environment=web"], "environment must be one of ['search', 'shop', 'webshop'], got"),
        (["environment=shop"], "reward must be environment with environment: shop"),
        (["reward=environment"], "reward must be an answer reward with environment: search"),
        ([*SHOP, "shop_split=dev"], "shop_split must be one of ['train', 'rl', 'test'], or"),
        ([*SHOP, "shop_split=rl+rl"], "shop_split must be one of ['train', 'rl', 'test'], or"),
        ([*SHOP, "shop_split=train+dev"], "shop_split must be one of ['train', 'rl', 'test'],"),
        ([*SHOP, "data=q.jsonl"], "data must be empty with environment: shop"),
        ([*SHOP, "retriever=http://x"], "retriever must be null with environment: shop"),
        (["shop_ids_from=3"], "shop_ids_from must be null unless environment: shop"),
        (["environment=webshop", "reward=environment"], "webshop_url must be a server's URL"),
        (["webshop_url=http://x"], "webshop_url must be a server's URL with environment: web"),
        ([*WEBSHOP, "data=q.jsonl"], "data must be empty with environment: webshop"),
        ([*WEBSHOP, "retriever=http://x"], "retriever must be null with environment: webshop"),
        ([*WEBSHOP, "shop_ids_from=3"], "shop_ids_from must be null unless environment: shop"),
        ([*WEBSHOP, "webshop_goals=[9,3]"], "webshop_goals must be [A, B] with 0 <= A < B"),
    ],
)
def test_each_environment_takes_only_what_it_can_use(overrides: list[str], message: str) -> None:
    with pytest.raises(MemSearcherError, match=re.escape(f"invalid config: {message}")):
        load_config(GRPOConfig, None, overrides)


def test_the_shop_section_is_checked_and_the_search_defaults_stay() -> None:
    with pytest.raises(MemSearcherError, match="shop.options_offered must be in 1..3"):
        load_config(GRPOConfig, None, [*SHOP, "shop.options_offered=9"])
    shop = load_config(GRPOConfig, None, [*SHOP, "shop.seed=4", "shop_split=test"])
    assert (shop.shop.seed, shop.shop_split, shop.agent_name) == (4, "test", "memsearcher")
    default = GRPOConfig()
    assert (default.environment, default.reward, default.data) == ("search", "graded", "")


def test_the_shop_trains_on_several_splits_joined_by_plus() -> None:
    """``shop_split: train+rl`` trains on both splits' instructions, and never the test split's."""
    from memsearcher.agent.environments.shop_world import generate_catalogue
    from memsearcher.rl.tasks import open_task

    small = [*SHOP, "shop.families_per_category=1"]
    config = load_config(GRPOConfig, None, [*small, "shop_split=train+rl"])
    shop = generate_catalogue(config.shop)
    by_split = {s: {i.id for i in shop.split(s)} for s in ("train", "rl", "test")}
    assert all(by_split.values())
    trained = {q.id for q in open_task(config).questions}
    assert trained == by_split["train"] | by_split["rl"]
    rl_only = load_config(GRPOConfig, None, small)
    assert {q.id for q in open_task(rl_only).questions} == by_split["rl"]


def test_the_shop_trains_under_another_shops_ids() -> None:
    """``shop_ids_from``: the trained shop's own products and instructions, under the ids of
    the shop of that seed, the same deal each time; without it, the shop's own ids."""
    from memsearcher.agent.environments.shop_world import generate_catalogue
    from memsearcher.rl.tasks import open_task

    small = [*SHOP, "shop.families_per_category=1", "shop.seed=5", "shop_split=train+rl+test"]
    own = open_task(load_config(GRPOConfig, None, small))
    config = load_config(GRPOConfig, None, [*small, "shop_ids_from=0"])
    task = open_task(config)
    trained = generate_catalogue(config.shop)
    owner_ids = {p.asin for p in generate_catalogue(replace(config.shop, seed=0)).products}
    assert {p.asin for p in trained.products}.isdisjoint(owner_ids)  # two shops, two id sets
    shop = task.environment.catalogue  # type: ignore[attr-defined]
    assert {p.asin for p in shop.products} == owner_ids
    assert [p.title for p in shop.products] == [p.title for p in trained.products]
    assert [q.question for q in task.questions] == [q.question for q in own.questions]
    for dealt, plain in zip(task.questions, own.questions, strict=True):  # each target kept
        assert shop.product(dealt.golden_answers[0]).title == (
            trained.product(plain.golden_answers[0]).title
        )
    again = open_task(config).environment.catalogue  # type: ignore[attr-defined]
    assert again == shop


@pytest.mark.parametrize("repeat_ends", [False, True])
def test_shop_repeat_ends_reaches_the_training_shop(repeat_ends: bool) -> None:
    from memsearcher.agent.environments.base import ShopAction
    from memsearcher.rl.tasks import open_task

    small = [*SHOP, "shop.families_per_category=1", f"shop_repeat_ends={repeat_ends}"]
    task = open_task(load_config(GRPOConfig, None, small))
    session = f"{task.questions[0].id}#0"
    pages = [
        task.environment.act([ShopAction(session, text)])[0]
        for text in ("", "search[cotton]", "click[B0NOTHERE0]", "click[B0NOTHERE0]")
    ]
    assert [page.done for page in pages] == [False, False, False, repeat_ends]


def test_one_registry_entry_makes_an_environment_for_training_and_evaluation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A name added to `agent.tasks.ENVIRONMENTS` and nowhere else is one that the RL config,
    the training task and evaluation all take (docs/architecture.md)."""
    from memsearcher.agent.shop_agents import ShopEpisode
    from memsearcher.agent.tasks import ENVIRONMENTS
    from memsearcher.eval.run import EvalConfig
    from memsearcher.llm import load_tokenizer
    from memsearcher.llm.embedded import embedded_model_path
    from memsearcher.rl.tasks import open_task

    with pytest.raises(MemSearcherError, match="environment must be one of"):
        load_config(GRPOConfig, None, ["environment=mart", "reward=environment"])
    monkeypatch.setitem(ENVIRONMENTS, "mart", ENVIRONMENTS["shop"])
    config = load_config(GRPOConfig, None, ["environment=mart", "reward=environment"])
    with pytest.raises(MemSearcherError, match="reward must be environment"):
        load_config(GRPOConfig, None, ["environment=mart"])
    task = open_task(config)
    tokenizer = load_tokenizer(str(embedded_model_path()))
    episodes = task.start_episodes(task.questions[:2], tokenizer, None)
    assert len(episodes) == 2 and all(isinstance(e, ShopEpisode) for e in episodes)
    assert EvalConfig(environment="mart", driver="async").environment == "mart"
