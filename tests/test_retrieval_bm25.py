"""BM25 indexes: bm25s's scores exactly, known-item retrieval, manifests and corpus checks."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import bm25s
import numpy as np
import pytest
import Stemmer

from memsearcher.retrieval import load_index
from memsearcher.retrieval.bm25 import BM25Config, BM25Index, Tokenizer, build_bm25
from memsearcher.retrieval.corpus import CorpusError, Passage, write_corpus
from memsearcher.retrieval.embedded import embedded_passages
from memsearcher.retrieval.manifest import IndexFolderError

SMALL = [
    Passage("a", "Eiffel Tower", "The Eiffel Tower is a wrought-iron lattice tower in Paris."),
    Passage("b", "Great Wall", "The Great Wall of China is a series of fortifications."),
    Passage("c", "Python", "Python is a programming language created by Guido van Rossum."),
    Passage("d", "Paris", "Paris is the capital and largest city of France."),
    Passage("e", "Empty", ""),
    Passage("f", "Towers", "Towers towers towers: the tower of Pisa leans; towers everywhere."),
]


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> BM25Index:
    root = tmp_path_factory.mktemp("bm25")
    write_corpus(root / "small.jsonl", SMALL)
    return build_bm25(root / "small.jsonl", root / "index")


@pytest.fixture(scope="module")
def wiki(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Passage], BM25Index]:
    root = tmp_path_factory.mktemp("wiki")
    passages = embedded_passages()[:3000]
    write_corpus(root / "wiki.jsonl", passages)
    # small chunks so the multi-chunk path (vocab growth, spills, counting sort) runs
    return passages, build_bm25(root / "wiki.jsonl", root / "index", BM25Config(chunk_size=700))


def test_tokenizer_matches_bm25s() -> None:
    text = "The towers of Paris, and THE Tower's 2 runners were running!"
    ours = Tokenizer("en", "english")(text)
    theirs = bm25s.tokenize(
        [text], stopwords="en", stemmer=Stemmer.Stemmer("english"), return_ids=False,
        show_progress=False,
    )  # fmt: skip
    assert ours == theirs[0]


def test_scores_equal_bm25s(wiki: tuple[list[Passage], BM25Index]) -> None:
    """Our streamed, chunked build gives bm25s's own index, score for score."""
    passages, index = wiki
    stemmer = Stemmer.Stemmer("english")
    texts = [f"{p.title} {p.text}" for p in passages]
    reference = bm25s.BM25()
    reference.index(
        bm25s.tokenize(texts, stopwords="en", stemmer=stemmer, show_progress=False),
        show_progress=False,
    )
    queries = [p.title for p in passages[::97]] + ["history of the roman empire", "music"]
    tokens = bm25s.tokenize(queries, stopwords="en", stemmer=stemmer, show_progress=False)
    ref_rows, ref_scores = reference.retrieve(tokens, k=10, show_progress=False)
    for query, (rows, scores), want_rows, want_scores in zip(
        queries, index.search_rows(queries, 10), ref_rows, ref_scores, strict=True
    ):
        positive = want_scores > 0  # we leave out passages that match no query term
        want_rows, want_scores = want_rows[positive], want_scores[positive]
        np.testing.assert_allclose(scores, want_scores, rtol=1e-6, err_msg=query)
        # rows may differ only inside ties
        tied = np.isclose(scores[:, None], want_scores[None, :], rtol=1e-6).any(axis=1)
        assert set(rows[~tied]) <= set(want_rows), query


def test_known_item_retrieval(wiki: tuple[list[Passage], BM25Index]) -> None:
    passages, index = wiki
    sample = random.Random(0).sample(passages, 200)
    results = index.search([p.text.split(".")[0] for p in sample], 5)
    found = sum(p.id in {h.id for h in hits} for p, hits in zip(sample, results, strict=True))
    assert found >= 190
    assert all(len(hits) <= 5 for hits in results)


def test_search_small(small: BM25Index) -> None:
    hits = small.search(["eiffel tower", "capital of France", "the of and", "zzzqqq"], 3)
    assert hits[0][0].id == "a" and hits[0][0].title == "Eiffel Tower"
    assert hits[0][0].text.startswith("The Eiffel Tower is")
    assert hits[1][0].id == "d"
    assert hits[2] == [] and hits[3] == []  # only stopwords / unknown words: no match
    scores = [h.score for h in hits[0]]
    assert scores == sorted(scores, reverse=True) and scores[-1] > 0


def test_top_n_clipped_and_checked(small: BM25Index) -> None:
    assert len(small.search(["tower paris python wall"], 1000)[0]) <= len(SMALL)
    assert small.search([], 5) == []
    with pytest.raises(ValueError):
        small.search(["x"], 0)
    with pytest.raises(TypeError):
        small.search("tower", 5)  # type: ignore[arg-type]


def test_manifest_describes_index(small: BM25Index) -> None:
    manifest = json.loads((small.folder / "manifest.json").read_text())
    assert manifest["kind"] == "bm25"
    assert manifest["passages"] == len(SMALL) == manifest["corpus"]["rows"]
    assert manifest["bm25"]["stemmer"] == "english" and manifest["bm25"]["method"] == "lucene"
    again = load_index(small.folder)
    assert isinstance(again, BM25Index)
    assert again.search(["python"], 1)[0][0].id == "c"


def test_load_checks_corpus(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(corpus, SMALL)
    build_bm25(corpus, tmp_path / "index")
    with pytest.raises(IndexFolderError, match="already exists"):
        build_bm25(corpus, tmp_path / "index")
    write_corpus(corpus, SMALL[:-1])  # the corpus changed under the index
    with pytest.raises(CorpusError, match="does not match"):
        BM25Index.load(tmp_path / "index")
    moved = tmp_path / "moved.jsonl"
    write_corpus(moved, SMALL)
    corpus.unlink()
    with pytest.raises(CorpusError, match="is gone"):
        BM25Index.load(tmp_path / "index")
    assert BM25Index.load(tmp_path / "index", corpus=moved).search(["python"], 1)[0][0].id == "c"
    with pytest.raises(IndexFolderError, match="not an index folder"):
        load_index(tmp_path)


def test_build_errors(tmp_path: Path) -> None:
    with pytest.raises(CorpusError, match="not found"):
        build_bm25(tmp_path / "nope.jsonl", tmp_path / "index")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "contents": "x"}\n{"id": "2"}\n', encoding="utf-8")
    with pytest.raises(CorpusError, match=r"bad.jsonl:2"):
        build_bm25(bad, tmp_path / "index")
    assert not (tmp_path / "index").exists()
    assert list(tmp_path.iterdir()) == [bad]  # no half-built folder left behind
    index = build_bm25(bad, tmp_path / "index", on_error="skip")
    assert len(index) == 1
    with pytest.raises(IndexFolderError, match="unknown BM25 method"):
        BM25Config(method="bm42")


# A stand-in for JAX that records the preallocation setting it is imported under, and the one
# function bm25s calls at import. The real JAX and a GPU are not on this machine.
FAKE_JAX = {
    "jax/__init__.py": "import os, pathlib\n"
    "pathlib.Path(os.environ['SEEN']).write_text("
    "os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE', 'unset'))\n",
    "jax/lax.py": "import numpy as np\n\n\ndef top_k(x, k):\n"
    "    order = np.argsort(-np.asarray(x))[:k]\n    return np.asarray(x)[order], order\n",
}


@pytest.mark.parametrize(("users", "seen"), [(None, "false"), ("true", "true")])
def test_loading_an_index_keeps_jax_from_taking_the_gpus_memory(
    small: BM25Index, tmp_path: Path, users: str | None, seen: str
) -> None:
    """bm25s imports JAX when it is installed and runs a top-k on JAX's default device, and
    JAX's default then holds 75% of a GPU: on a lent H200 two GRPO trainers died of CUDA out
    of memory before their first step. Loading an index tells JAX to allocate as it goes,
    unless the user chose otherwise."""
    for name, text in FAKE_JAX.items():
        (tmp_path / "site" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "site" / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
    path = os.pathsep.join([str(tmp_path / "site"), env.get("PYTHONPATH", "")])
    env |= {"SEEN": str(tmp_path / "seen"), "PYTHONPATH": path}
    if users is not None:
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = users
    code = ("import sys; from memsearcher.retrieval.bm25 import BM25Index; "
            "print(BM25Index.load(sys.argv[1]).search(['capital'], 1)[0][0].id)")  # fmt: skip
    ran = subprocess.run([sys.executable, "-c", code, str(small.folder)], env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["d"]
    assert (tmp_path / "seen").read_text() == seen
