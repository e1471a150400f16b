"""The embedded agent's recipe config (`memsearcher.recipe.embedded_agent` runs it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from memsearcher.agent import AgentConfig
from memsearcher.config import positive, require
from memsearcher.errors import MemSearcherError
from memsearcher.llm.embedded import resolve_model
from memsearcher.rl.config import GRPOConfig, SFTConfig
from memsearcher.teach.config import ProtocolDataConfig
from memsearcher.teach.oracle import AGENTS

__all__ = ["RecipeConfig"]


@dataclass(frozen=True)
class RecipeConfig:
    """The whole recipe; ``sft`` and ``grpo`` are the trainers' own configs, whose data,
    output and start model the recipe sets."""

    out: str = "runs/embedded-agent"
    """Where every stage writes (see the module's docstring)."""
    agents: tuple[str, ...] = AGENTS
    """The agents trained by GRPO. SFT trains on the teacher's trajectories of every agent of
    `memsearcher.teach.oracle.AGENTS`, and the SFT model is evaluated as each of them."""
    build: ProtocolDataConfig = field(default_factory=ProtocolDataConfig)
    """The teacher's data and the Wikipedia question splits."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """SFT of the raw model (its model.path) on the teacher's data."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """GRPO of each agent from the SFT model, on the rl questions."""
    turn1_steps: int = 0
    """Steps (of ``sft.sequences_per_step``) of a second SFT pass, a fresh LoRA over the SFT
    model, on turn 1's sequence of every Wikipedia trajectory of the teacher's data: the turn
    after the first search, where a two-hop question needs a second search (try 8 of
    docs/embedded-agent.md). GRPO then starts from its model. 0: no second pass."""
    turn1_lr: float = 1e-3
    """The second pass's peak learning rate (its schedule is ``sft.optim``'s)."""
    rl_one_hop: int = 48
    """One-hop rl questions GRPO trains on, beside every answerable two-hop one."""
    test_one_hop: int = 48
    """One-hop test questions evaluated, beside every answerable two-hop one."""
    rl_worlds: int = 0
    """Synthetic worlds whose multi-hop rl questions (``rl_world_questions`` each) join GRPO's
    questions: the worlds after the SFT data's seeds (worlds SFT never saw; their invented
    names rarely repeat those it did), their passages indexed with the embedded Wikipedia's
    for GRPO alone (``data/rl-index``). Only a search per hop answers them; on the
    Wikipedia's rl two-hop questions the answer is in view after the first search in 27 of
    33 (docs/embedded-agent.md). 0: none."""
    rl_world_questions: int = 4
    """Multi-hop questions drawn from each of the ``rl_worlds``."""
    select_every: int = 0
    """Score every this-many-th GRPO checkpoint, and the last, greedily on the selection
    questions, and make the best one (the earliest on a tie) GRPO's model: merged, exported,
    evaluated and shipped. The step to stop at is so chosen without the held-out or test
    questions; past it, GRPO gains on the questions it trained on while unseen ones fall
    back (try 9 of docs/embedded-agent.md). A multiple of ``grpo.save_every``. 0: the last
    step."""
    select_worlds: int = 20
    """Synthetic worlds, after the SFT data's and GRPO's (so neither ever saw them), whose
    multi-hop rl questions, ``select_world_questions`` each, are drawn; the two-hop ones the
    ideal teacher answers are the selection questions (``data/questions/select.jsonl``,
    searched in ``data/select-index``: the embedded Wikipedia's passages and these worlds').
    Three-hop ones are left out: at 4 turns none of try 9's checkpoints answered one (they
    spend the last turn on another search), so they would only cost time."""
    select_world_questions: int = 5
    """Multi-hop questions drawn from each of the ``select_worlds``."""
    evaluation: AgentConfig = field(
        default_factory=lambda: AgentConfig(
            max_turns=4, memory_tokens=128, max_new_tokens=64, top_n=3
        )
    )
    """Turn budget, generation budgets and passages per search of evaluation (greedy)."""
    evaluation_limit: int = 0
    """Evaluate only the first this many questions of each dataset (0: all of them)."""
    bootstrap: int = 10000
    """Resamples of the paired bootstrap of the GRPO - SFT gain."""
    ship: str = ""
    """A folder (the package's ``src/memsearcher/llm/adapters``) to write the SFT adapter, the
    turn-1 one (with ``turn1_steps``) and MemSearcher's GRPO adapter into; "" writes them only
    under ``out``."""

    def __post_init__(self) -> None:
        require(self, "agents", set(self.agents) <= set(AGENTS) and bool(self.agents),
                f"some of {list(AGENTS)}")  # fmt: skip
        require(self, "turn1_steps", self.turn1_steps >= 0, ">= 0 (0: no second pass)")
        require(self, "turn1_lr", self.turn1_lr > 0, "> 0")
        require(self, "rl_one_hop", self.rl_one_hop >= 0, ">= 0")
        require(self, "test_one_hop", self.test_one_hop >= 0, ">= 0")
        require(self, "rl_worlds", self.rl_worlds >= 0, ">= 0 (0: none)")
        positive(self, "rl_world_questions")
        require(self, "select_every", self.select_every >= 0, ">= 0 (0: the last step)")
        require(self, "select_every", self.select_every % self.grpo.save_every == 0,
                f"a multiple of grpo.save_every ({self.grpo.save_every}), whose checkpoints "
                "it scores")  # fmt: skip
        positive(self, "select_worlds", "select_world_questions")
        require(self, "evaluation_limit", self.evaluation_limit >= 0, ">= 0 (0: all)")
        positive(self, "bootstrap")
        for trainer in (self.sft, self.grpo):
            require(trainer, "steps", trainer.steps > 0, "> 0 in the recipe (it resumes by step)")
        require(self.build, "heldout", bool(self.build.heldout), "the held-out questions' file")
        require(self, "ship", not self.ship or "memsearcher" in self.agents,
                "empty unless memsearcher is among the agents (its adapter ships)")  # fmt: skip
        if self.sft.model.lora_rank < 1 or self.grpo.model.lora_rank < 1:
            raise MemSearcherError(
                "the recipe ships LoRA adapters: sft.model.lora_rank and grpo.model.lora_rank "
                "must be > 0"
            )

    @property
    def base(self) -> str:
        """The raw model SFT starts from, as a folder or hub id."""
        return resolve_model(self.sft.model.path)
