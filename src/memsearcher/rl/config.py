"""Training configs: one frozen dataclass per component, loaded from YAML plus overrides
(`memsearcher.config.load_config`).

Values out of range (a NaN or negative learning rate, beta < 0) and names missing from their
registry (an unknown agent, reward, aggregation or schedule) are errors, checked when the config
is built, so ``--print-config`` catches them, and named by their dotted key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memsearcher.agent.base import AgentConfig, check_trainable
from memsearcher.agent.environments.shop_world import SPLITS, ShopConfig
from memsearcher.agent.tasks import ENVIRONMENTS
from memsearcher.config import config_to_dict, count, finite, load_config, positive, require
from memsearcher.errors import MemSearcherError
from memsearcher.retrieval.cache import DEFAULT_CACHE_SIZE
from memsearcher.rl.schedules import SCHEDULES

__all__ = [
    "ADVANTAGES",
    "LEARNERS",
    "CriticConfig",
    "GRPOConfig",
    "ModelConfig",
    "OptimConfig",
    "SFTConfig",
    "config_to_dict",
    "load_config",
]

DTYPES = ("float32", "bfloat16", "float16")

# Below this lr, AdamW's steps (about lr per update) are smaller than half the bfloat16 spacing
# (|w| / 512) of every weight larger than lr * 512 (0.05 at 1e-4): such weights never move.
LOW_PRECISION_MIN_LR = 1e-4

MAX_MICRO_BATCH_TOKENS = 1 << 24
"""Padded tokens of one forward/backward pass: 16M tokens' activations fit on no accelerator."""

ADVANTAGES = ("grpo", "gae")
"""grpo: each trajectory's group-normalized reward on all its tokens (DESIGN.md section 6);
gae: PPO with a critic, per-token advantages by GAE (MEM1's algorithm, `memsearcher.rl.critic`)."""

LEARNERS = ("per-turn", "packed")
"""How the learner lays out a trajectory's turns: one row each, or one packed row
(`memsearcher.rl.packing`); the log-probs and gradient are the same."""


@dataclass(frozen=True)
class ModelConfig:
    """Which model to train and how it sits in memory."""

    path: str = "embedded"
    """An HF folder or hub id; "embedded" is the packaged SmolLM2-135M-Instruct with its SFT and
    GRPO adapters merged in (the other packaged names: `memsearcher.llm.embedded.MODELS`),
    "embedded-base" the raw model."""
    dtype: str = "float32"
    """Parameter dtype (the optimizer's master weights): float32, or bfloat16 / float16 for
    frozen weights under LoRA; bfloat16 trainable weights need lr >= 1e-4 (docs/training.md)."""
    device: str = "auto"
    """auto, cpu or cuda; under distributed launch each rank takes cuda:LOCAL_RANK."""
    lora_rank: int = 0
    """0 trains every weight; > 0 trains LoRA adapters of this rank (peft)."""
    lora_alpha: int = 32
    """LoRA scaling numerator."""
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """Module names that get LoRA adapters."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    autocast: str | None = "auto"
    """Compute dtype of forward passes over the weights: auto (bfloat16 on a GPU that has it,
    none on a CPU), bfloat16, float16, or null for the weights' own dtype."""
    rollout_batch_size: int = 32
    """Prompts per batched generate call of the in-process backend."""
    distributed: str = "ddp"
    """How several ranks hold the model: ddp (a full replica each) or fsdp (sharded, GPUs)."""
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    """Variables for the tokenizer's chat template, e.g. ``{enable_thinking: false}`` for
    Qwen3 (veRL's ``data.apply_chat_template_kwargs``)."""

    def __post_init__(self) -> None:
        _check_model(self)
        if self.dtype not in DTYPES:
            raise MemSearcherError(f"model.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.autocast not in (None, "auto", "bfloat16", "float16"):
            raise MemSearcherError(
                f"model.autocast must be auto, null, bfloat16 or float16, got {self.autocast!r}"
            )


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = 1e-6
    """Peak learning rate."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW moment coefficients."""
    warmup_steps: int = 0
    """Optimizer updates of linear warm-up from 0."""
    schedule: str = "constant"
    """After warm-up: constant, or cosine towards 0 at the end (as HF's cosine schedule)."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this (0 disables clipping)."""

    def __post_init__(self) -> None:
        require(self, "lr", finite(self.lr) and self.lr > 0, "a finite number > 0")
        require(self, "weight_decay", finite(self.weight_decay) and self.weight_decay >= 0,
                "a finite number >= 0")  # fmt: skip
        require(self, "betas", all(finite(b) and 0 <= b < 1 for b in self.betas),
                "two numbers in [0, 1)")  # fmt: skip
        require(self, "warmup_steps", self.warmup_steps >= 0, ">= 0")
        require(self, "schedule", self.schedule in SCHEDULES, f"one of {sorted(SCHEDULES)}")
        require(self, "max_grad_norm", finite(self.max_grad_norm) and self.max_grad_norm >= 0,
                "a finite number >= 0 (0 disables clipping)")  # fmt: skip


@dataclass(frozen=True)
class CriticConfig:
    """The value model of ``advantage: gae``. Defaults are MEM1's (veRL's PPO)."""

    path: str | None = None
    """Where the critic starts (an HF folder or hub id, or "embedded"); None: model.path."""
    lr: float = 1e-5
    """The critic's AdamW learning rate (MEM1: ten times the actor's)."""
    value_clip: float = 0.5
    """How far a value may move from its old value before its error stops counting."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 1.0
    """GAE lambda."""
    kl_reward: float = 0.0
    """Per-token reward penalty kl_reward * (log pi_old - log pi_ref) (MEM1: 0.001)."""
    whiten: bool = True
    """Whiten the advantages over the step's action tokens on each rank (as veRL)."""

    def __post_init__(self) -> None:
        require(self, "lr", finite(self.lr) and self.lr > 0, "a finite number > 0")
        require(self, "value_clip", finite(self.value_clip) and self.value_clip >= 0,
                "a finite number >= 0")  # fmt: skip
        require(self, "gamma", finite(self.gamma) and 0 <= self.gamma <= 1, "in [0, 1]")
        require(self, "lam", finite(self.lam) and 0 <= self.lam <= 1, "in [0, 1]")
        require(self, "kl_reward", finite(self.kl_reward) and self.kl_reward >= 0,
                "a finite number >= 0")  # fmt: skip


@dataclass(frozen=True)
class GRPOConfig:
    """Multi-context GRPO (DESIGN.md section 6). Defaults are the paper's reference values."""

    data: str = ""
    """Training questions, FlashRAG JSONL (environment: search)."""
    output_dir: str = "runs/grpo"
    """Checkpoints, metrics.jsonl, TensorBoard events and sample trajectories go here."""
    agent_name: str = "memsearcher"
    """memsearcher or react."""
    environment: str = "search"
    """search: the questions of ``data`` over ``retriever``; shop: the instructions of the
    generated shop (``shop``, ``shop_split``) in its pages, with reward: environment; webshop:
    the goals ``webshop_goals`` of the WebShop server at ``webshop_url``, the same way."""
    shop_split: str = "rl"
    """The shop's instructions to train on (environment: shop): train, rl or test, or several
    joined by ``+`` (``train+rl``: the demo's SFT never sees the tested shop's train split)."""
    shop_repeat_ends: bool = False
    """environment: shop: an invalid action written again right after itself ends the episode
    with reward 0 (`ShopEnv`), so that RL pays for leaving the page a memory agent would
    otherwise loop on under greedy decoding."""
    shop_ids_from: int | None = None
    """environment: shop: the seed of a shop of the same sizes whose product ids the trained
    shop's products take, dealt at random (`deal_ids`), so that a model whose vocabulary holds
    one shop's ids trains on another shop's instructions (the shop demo's ``rl_shop: fresh``);
    None: the shop's own ids."""
    webshop_url: str | None = None
    """environment: webshop: the server, princeton-nlp's WebShop or ours (``python -m
    memsearcher.agent.environments.shop_server``), e.g. http://127.0.0.1:3000."""
    webshop_goals: tuple[int, int] = (1500, 12087)
    """environment: webshop: the goals A .. B-1 as ``[A, B]`` (sessions ``fixed_A`` ..
    ``fixed_{B-1}``); of WebShop's 12,087 goals, 0-499 are its test split, 500-1499
    validation, and 1500-12086 (10,587) training."""
    retriever: str | None = None
    """None: the embedded BM25; an http(s) URL: a retrieval server; else an index folder."""
    retriever_cache: int = DEFAULT_CACHE_SIZE
    """Search answers kept in an LRU, each distinct query of a round searched once (a group's
    samples often repeat their first query: docs/retrieval.md); 0 disables both."""
    templates: str | None = None
    """A YAML/JSON file overriding the prompt templates (`Templates`'; with environment:
    shop, `ShopTemplates`')."""
    seed: int = 0
    """Seeds data order, sampling and initialization."""
    steps: int = 0
    """Training steps; 0 means one pass over the questions."""
    questions_per_step: int = 256
    """Questions per step over all ranks."""
    mini_batch_questions: int = 128
    """Questions per optimizer update (their G trajectories, all turns)."""
    group_size: int = 5
    """Trajectories per question (G)."""
    ppo_epochs: int = 1
    """Passes over each step's rollouts."""
    micro_batch_tokens: int = 16384
    """Padded tokens per forward/backward pass (gradient accumulation inside a mini-batch)."""
    share_prefix: bool = False
    """Compute the tokens all sequences of a micro-batch, or all prompts of a rollout batch,
    start with (the system prompt) once (`memsearcher.rl.batching`, `memsearcher.llm.decode`);
    exact to float rounding; one process only."""
    learner: str = "per-turn"
    """per-turn: every turn sequence is its own row; packed: each trajectory is one row, its
    shared prompt prefix once and its turns as segments under a block mask
    (`memsearcher.rl.packing`): the same log-probs and gradient with about a third fewer
    tokens for MemSearcher and MEM1, slower on a CPU (docs/mem1.md)."""
    reuse_logprobs: bool = False
    """With one update a step (GRPO), take the update's own log-probs, detached, as the old
    ones instead of recomputing them from the same weights in a pass of their own: equal to
    float rounding, one forward pass fewer."""
    temperature: float = 1.0
    """Sampling temperature of rollouts and of the log-probabilities."""
    top_p: float = 1.0
    """Nucleus mass of rollouts; must be 1: the learner's log-probs are of the untruncated
    softmax(logits / temperature), the distribution rollouts are drawn from."""
    clip_low: float = 0.2
    """PPO ratio clip below 1."""
    clip_high: float = 0.2
    """PPO ratio clip above 1."""
    beta: float = 0.001
    """Weight of the k3 KL penalty to the initial model; 0 skips the reference model."""
    aggregation: str = "token-mean"
    """token-mean, sequence-mean or trajectory-mean (memsearcher.rl.loss.AGGREGATIONS)."""
    reward: str = "graded"
    """A key of memsearcher.rl.rewards.REWARDS."""
    advantage: str = "grpo"
    """grpo (group-normalized, one per trajectory) or gae (PPO with a critic, section critic)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus on action tokens (MEM1: 0.001)."""
    normalize_std: bool = True
    """Divide group-centred rewards by the group's std."""
    filter_degenerate: bool = False
    """Drop groups whose rewards are all equal (zero advantage) from the update."""
    log_every: int = 1
    """Steps between log lines."""
    save_every: int = 50
    """Steps between checkpoints (the last step is always saved)."""
    sample_every: int = 10
    """Steps between saved sample trajectories (0 disables)."""
    tensorboard: bool = True
    """Write TensorBoard events (needs the tensorboard package)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and schedule."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Turn budget, memory cap, generation budgets."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """The value model, used with advantage: gae."""
    shop: ShopConfig = field(default_factory=ShopConfig)
    """The seed and sizes of the generated shop (environment: shop)."""

    def __post_init__(self) -> None:
        _check_grpo(self)
        _check_environment(self)
        positive(self, "questions_per_step", "mini_batch_questions", "group_size", "ppo_epochs")
        positive(self, "log_every", "save_every")
        count(self, "micro_batch_tokens", MAX_MICRO_BATCH_TOKENS)
        if self.questions_per_step % self.mini_batch_questions:
            raise MemSearcherError(
                f"questions_per_step ({self.questions_per_step}) must be a multiple of "
                f"mini_batch_questions ({self.mini_batch_questions})"
            )
        if self.temperature <= 0:
            raise MemSearcherError(f"temperature must be > 0 for GRPO, got {self.temperature}")
        if self.top_p != 1.0:
            raise MemSearcherError(
                f"top_p={self.top_p}: GRPO samples from softmax(logits / temperature) because "
                "that is the distribution its log-probs and ratios model; nucleus truncation "
                "would make every rollout off-policy by an amount the ratio cannot see"
            )
        check_trainable(self.agent, "agent")
        _check_precision(self.model, self.optim)
        if self.advantage == "gae":
            _check_critic_precision(self.model, self.critic)

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per training step."""
        return self.ppo_epochs * (self.questions_per_step // self.mini_batch_questions)


@dataclass(frozen=True)
class SFTConfig:
    """Supervised fine-tuning on trajectories: the distillation baseline."""

    data: str = ""
    """Trajectory JSONL, one Trajectory.to_dict() per line."""
    output_dir: str = "runs/sft"
    """Checkpoints, metrics.jsonl and TensorBoard events go here."""
    seed: int = 0
    """Seeds data order."""
    steps: int = 0
    """Optimizer updates; 0 means `epochs` passes over the sequences."""
    epochs: int = 1
    """Passes over the data when steps is 0."""
    only_well_formed: bool = True
    """Skip trajectories that did not end with a parsed answer."""
    sequences_per_step: int = 32
    """Turn sequences per optimizer update."""
    micro_batch_tokens: int = 16384
    """Padded tokens per forward/backward pass."""
    share_prefix: bool = False
    """Compute the tokens all sequences of a micro-batch start with (the system prompt) once
    per micro-batch, sequences grouped by that prompt (`memsearcher.rl.batching`); exact to
    float rounding; one process only."""
    log_every: int = 1
    """Steps between log lines."""
    save_every: int = 100
    """Steps between checkpoints (the last step is always saved)."""
    tensorboard: bool = True
    """Write TensorBoard events (needs the tensorboard package)."""
    max_sequence_tokens: int = 0
    """Drop sequences longer than this many tokens (0 keeps all)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer and schedule."""

    def __post_init__(self) -> None:
        require(self, "max_sequence_tokens", self.max_sequence_tokens >= 0, ">= 0")
        positive(self, "epochs", "sequences_per_step", "log_every")
        count(self, "micro_batch_tokens", MAX_MICRO_BATCH_TOKENS)
        positive(self, "save_every")
        require(self, "steps", self.steps >= 0, ">= 0 (0: epochs passes over the data)")
        require(self, "seed", self.seed >= 0, ">= 0")
        _check_precision(self.model, self.optim)


def _check_precision(model: ModelConfig, optim: OptimConfig) -> None:
    """Refuse trainable half-precision weights at a learning rate their spacing rounds away."""
    if model.dtype == "float32" or model.lora_rank > 0:  # LoRA adapters are kept in float32
        return
    if optim.lr < LOW_PRECISION_MIN_LR:
        raise MemSearcherError(
            f"model.dtype={model.dtype} with optim.lr={optim.lr:g}: AdamW steps this small "
            f"round away in {model.dtype} (a weight w moves only if the step exceeds about "
            "|w|/512), so full fine-tuning would not train. Keep model.dtype=float32 (the "
            "default; forward passes still run in bfloat16 under model.autocast) or train LoRA "
            "adapters (model.lora_rank > 0)"
        )


def _check_critic_precision(model: ModelConfig, critic: CriticConfig) -> None:
    """The same for the critic, which loads in ``model.dtype`` and trains every weight (LoRA
    is the policy's only)."""
    if model.dtype != "float32" and critic.lr < LOW_PRECISION_MIN_LR:
        raise MemSearcherError(
            f"model.dtype={model.dtype} with advantage=gae and critic.lr={critic.lr:g}: the "
            f"critic loads in {model.dtype} and trains every weight, even under LoRA, and "
            "AdamW steps this small round away there. Keep model.dtype=float32 (the default; "
            "forward passes still run in bfloat16 under model.autocast)"
        )


def _check_model(config: ModelConfig) -> None:
    require(config, "lora_rank", config.lora_rank >= 0, ">= 0 (0 trains every weight)")
    require(config, "lora_alpha", config.lora_alpha > 0, "> 0")
    require(config, "rollout_batch_size", config.rollout_batch_size >= 1, ">= 1")
    require(config, "distributed", config.distributed in ("ddp", "fsdp"), "ddp or fsdp")


def _check_grpo(config: GRPOConfig) -> None:
    """Ranges, and names looked up in the registries they select from."""
    from memsearcher.agent import AGENTS
    from memsearcher.rl.loss import AGGREGATIONS
    from memsearcher.rl.rewards import REWARDS

    require(config, "agent_name", config.agent_name in AGENTS, f"one of {sorted(AGENTS)}")
    require(config, "aggregation", config.aggregation in AGGREGATIONS,
            f"one of {sorted(AGGREGATIONS)}")  # fmt: skip
    require(config, "reward", config.reward in REWARDS, f"one of {sorted(REWARDS)}")
    require(config, "learner", config.learner in LEARNERS, f"one of {list(LEARNERS)}")
    require(config, "share_prefix", not (config.share_prefix and config.learner == "packed"),
            "false with learner: packed, which already computes each trajectory's shared "
            "prefix once")  # fmt: skip
    require(config, "beta", finite(config.beta) and config.beta >= 0,
            "a finite number >= 0 (0 skips the reference model)")  # fmt: skip
    require(config, "clip_low", finite(config.clip_low) and 0 <= config.clip_low < 1,
            "in [0, 1)")  # fmt: skip
    require(config, "clip_high", finite(config.clip_high) and config.clip_high >= 0,
            "a finite number >= 0")  # fmt: skip
    require(config, "temperature", finite(config.temperature), "a finite number")
    require(config, "steps", config.steps >= 0, ">= 0 (0: one pass over the questions)")
    require(config, "sample_every", config.sample_every >= 0, ">= 0 (0 disables)")
    require(config, "seed", config.seed >= 0, ">= 0")
    count(config, "retriever_cache", 1 << 24, low=0)
    require(config, "advantage", config.advantage in ADVANTAGES, f"one of {list(ADVANTAGES)}")
    require(config, "entropy_coef", finite(config.entropy_coef) and config.entropy_coef >= 0,
            "a finite number >= 0")  # fmt: skip
    if config.advantage == "grpo":
        rule = ">= 2 with advantage: grpo (one trajectory is its own group mean: advantage 0)"
        require(config, "group_size", config.group_size >= 2, rule)
    if config.advantage == "gae":
        rule = "false with advantage: gae (groups are GRPO's; the critic learns from all)"
        require(config, "filter_degenerate", not config.filter_degenerate, rule)


def _check_environment(config: GRPOConfig) -> None:
    """What each environment takes (`agent.tasks.ENVIRONMENTS`): the reward is the
    environment's where it gives one (the shop's) and the answer's where it gives none (search
    QA); the shop brings its own instructions."""
    envs = list(ENVIRONMENTS)
    require(config, "environment", config.environment in envs, f"one of {envs}")
    name = config.environment
    if ENVIRONMENTS[name].own_reward:
        rule = f"environment with environment: {name} (the reward it gives at the end)"
        require(config, "reward", config.reward == "environment", rule)
    else:
        rule = f"an answer reward with environment: {name}, whose environment gives none"
        require(config, "reward", config.reward != "environment", rule)
    if name != "shop":
        rule = "null unless environment: shop (another shop's ids for the trained shop)"
        require(config, "shop_ids_from", config.shop_ids_from is None, rule)
    rule = "a server's URL with environment: webshop, else null"
    require(config, "webshop_url", (name == "webshop") == bool(config.webshop_url), rule)
    if name == "search":
        return
    if name == "shop":
        splits = config.shop_split.split("+")
        known = set(splits) <= set(SPLITS) and len(set(splits)) == len(splits)
        require(config, "shop_split", known, f"one of {list(SPLITS)}, or several joined by +")
    if name == "webshop":
        first, end = config.webshop_goals
        require(config, "webshop_goals", 0 <= first < end, "[A, B] with 0 <= A < B")
    rule = f"empty with environment: {name} (the shop brings its instructions)"
    require(config, "data", not config.data, rule)
    rule = f"null with environment: {name} (the shop searches its own products)"
    require(config, "retriever", config.retriever is None, rule)
