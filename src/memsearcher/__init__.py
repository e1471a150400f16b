"""MemSearcher: an LLM search agent with a compact memory, trained with multi-context GRPO."""

from memsearcher.types import Hit, QAExample, TokenSequence, Trajectory, Turn

__all__ = ["Hit", "QAExample", "TokenSequence", "Trajectory", "Turn"]
__version__ = "0.1.0"
