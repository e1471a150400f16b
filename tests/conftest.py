"""Shared fixtures: the real embedded model and the real embedded BM25 index.

They use the normal cache (``$MEMSEARCHER_HOME`` or ``~/.cache/memsearcher``), so the one-time
model conversion is shared with the CLI and with later test runs.
"""

from __future__ import annotations

import pytest

from memsearcher.llm.hf import HFModel
from memsearcher.retrieval.base import Retriever


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--learning-seed",
        type=int,
        default=0,
        help="seed of the tests that assert training improved something; another seed stands "
        "in for another machine (benchmarks/learning_margins.py runs them over several)",
    )


@pytest.fixture(scope="session")
def learning_seed(request: pytest.FixtureRequest) -> int:
    """The seed every learning test draws its model, data order and sampling from."""
    return int(request.config.getoption("--learning-seed"))


@pytest.fixture(scope="session")
def llm() -> HFModel:
    from memsearcher.llm.embedded import embedded_model_path

    return HFModel.from_pretrained(str(embedded_model_path()), device="cpu")


@pytest.fixture(scope="session")
def retriever() -> Retriever:
    from memsearcher.retrieval import load_embedded_retriever

    return load_embedded_retriever()
