"""Dense and hybrid indexes with the packaged all-MiniLM-L6-v2 encoder, and fusion math."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from memsearcher.retrieval import load_index
from memsearcher.retrieval.corpus import CorpusError, Passage, write_corpus
from memsearcher.retrieval.dense import (
    DenseIndex,
    EncoderConfig,
    FaissConfig,
    build_dense,
    default_nlist,
    embeddings_of,
    resolve_prefixes,
)
from memsearcher.retrieval.embedded import embedded_passages
from memsearcher.retrieval.hybrid import (
    HybridConfig,
    HybridIndex,
    build_hybrid,
    fuse_linear,
    fuse_rrf,
)
from memsearcher.retrieval.manifest import IndexFolderError


def short_passages(n: int) -> list[Passage]:
    """The first sentence of every 40th summary: varied topics, cheap to encode on a CPU."""
    picked = embedded_passages()[::40][:n]
    return [Passage(p.id, p.title, p.text.split(". ")[0] + ".") for p in picked]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Passage]]:
    root = tmp_path_factory.mktemp("dense")
    passages = short_passages(120)
    write_corpus(root / "corpus.jsonl", passages)
    return root / "corpus.jsonl", passages


@pytest.fixture(scope="module")
def flat(corpus: tuple[Path, list[Passage]]) -> DenseIndex:
    path, _ = corpus
    return build_dense(path, path.parent / "flat", keep_embeddings=True)


def test_fusions_by_hand() -> None:
    bm25 = (np.array([7, 3, 5]), np.array([9.0, 4.0, 1.0]))
    dense = (np.array([3, 8]), np.array([0.8, 0.6]))
    rows, scores = fuse_rrf([bm25, dense], [0.5, 0.5], k=60)
    # row 3: 0.5/62 + 0.5/61; row 7: 0.5/61; row 8: 0.5/62; row 5: 0.5/63
    assert rows.tolist() == [3, 7, 8, 5]
    assert scores[0] == pytest.approx(0.5 / 62 + 0.5 / 61)
    rows, scores = fuse_linear([bm25, dense], [0.25, 0.75])
    # min-max: bm25 7 -> 1, 3 -> 0.375, 5 -> 0; dense 3 -> 1, 8 -> 0
    expected = {3: 0.25 * 0.375 + 0.75, 7: 0.25, 8: 0.0, 5: 0.0}
    assert rows.tolist() == [3, 7, 5, 8]  # ties broken by row number
    assert scores.tolist() == pytest.approx([expected[r] for r in rows.tolist()])
    empty = (np.zeros(0, np.int64), np.zeros(0, np.float32))
    assert fuse_linear([empty, dense], [0.5, 0.5])[0].tolist() == [3, 8]


def test_prefixes_resolved() -> None:
    plain = SimpleNamespace(prompts={})
    assert resolve_prefixes(EncoderConfig("intfloat/e5-base-v2"), plain) == ("query: ", "passage: ")
    assert resolve_prefixes(EncoderConfig("embedded"), plain) == ("", "")
    declared = SimpleNamespace(prompts={"query": "Q: ", "document": "D: "})
    assert resolve_prefixes(EncoderConfig("some/model"), declared) == ("Q: ", "D: ")
    explicit = EncoderConfig("intfloat/e5-base-v2", query_prefix="", passage_prefix="p ")
    assert resolve_prefixes(explicit, plain) == ("", "p ")


def test_default_nlist() -> None:
    assert default_nlist(10) == 1
    assert default_nlist(1_000_000) == 1024
    assert default_nlist(21_000_000) == 4096


def test_known_item_retrieval(flat: DenseIndex, corpus: tuple[Path, list[Passage]]) -> None:
    _, passages = corpus
    questions = [f"what is {p.title}?" for p in passages]
    results = flat.search(questions, 5)
    found = [p.id in {h.id for h in hits} for p, hits in zip(passages, results, strict=True)]
    assert np.mean(found) >= 0.9
    top = results[0][0]
    assert top.title and top.text and -1.0 <= top.score <= 1.0001
    assert len(flat.search(["anything"], 1000)[0]) == len(passages)  # top_n clipped


def test_manifest_and_reload(flat: DenseIndex) -> None:
    manifest = json.loads((flat.folder / "manifest.json").read_text())
    dense = manifest["dense"]
    assert manifest["kind"] == "dense" and dense["dim"] == 384
    assert dense["encoder"]["name"] == "embedded" and dense["encoder"]["query_prefix"] == ""
    assert dense["faiss"]["kind"] == "flat" and dense["kept_embeddings"]
    assert embeddings_of(flat.folder).shape == (manifest["passages"], 384)
    again = load_index(flat.folder)
    assert isinstance(again, DenseIndex)
    assert again.search(["jazz"], 3)[0][0].id == flat.search(["jazz"], 3)[0][0].id


@pytest.mark.slow
def test_ann_kinds_from_kept_embeddings(
    flat: DenseIndex, corpus: tuple[Path, list[Passage]]
) -> None:
    path, passages = corpus
    questions = [f"what is {p.title}?" for p in passages[:40]]
    truth = [[h.id for h in hits] for hits in flat.search(questions, 5)]
    hnsw = build_dense(
        path, path.parent / "hnsw", index=FaissConfig(kind="hnsw", hnsw_m=8),
        embeddings_from=flat.folder,
    )  # fmt: skip
    assert hnsw.manifest["encode_seconds"] == 0  # nothing was encoded again
    ids = [[h.id for h in hits] for hits in hnsw.search(questions, 5)]
    assert ids == truth  # 120 vectors: the graph search is exhaustive
    small = FaissConfig(kind="ivfpq", nlist=2, nprobe=2, pq_m=16, pq_bits=4, threads=1)
    ivfpq = build_dense(path, path.parent / "ivfpq", index=small, embeddings_from=flat.folder)
    record = ivfpq.manifest["dense"]
    assert record["faiss"]["nlist"] == 2
    assert record["index_bytes"] < flat.manifest["dense"]["index_bytes"] / 4
    results = ivfpq.search(questions, 5)
    overlap = [len(set(a) & {h.id for h in b}) / 5 for a, b in zip(truth, results, strict=True)]
    assert np.mean(overlap) > 0.5
    reloaded = DenseIndex.load(ivfpq.folder, nprobe=1)
    assert reloaded.search_params["nprobe"] == 1


def test_bad_settings(flat: DenseIndex, corpus: tuple[Path, list[Passage]]) -> None:
    path, _ = corpus
    with pytest.raises(IndexFolderError, match="unknown FAISS index"):
        FaissConfig(kind="lsh")
    with pytest.raises(IndexFolderError, match="must divide"):
        build_dense(
            path, path.parent / "bad", index=FaissConfig(kind="ivfpq", pq_m=7),
            embeddings_from=flat.folder,
        )  # fmt: skip
    other = path.parent / "other.jsonl"
    write_corpus(other, short_passages(3))
    with pytest.raises(CorpusError, match="does not match"):
        build_dense(other, path.parent / "bad2", embeddings_from=flat.folder)


@pytest.mark.slow
def test_hybrid(corpus: tuple[Path, list[Passage]]) -> None:
    path, passages = corpus
    hybrid = build_hybrid(path, path.parent / "hybrid", HybridConfig(depth=20))
    assert isinstance(load_index(hybrid.folder), HybridIndex)
    manifest = json.loads((hybrid.folder / "manifest.json").read_text())
    assert manifest["kind"] == "hybrid" and manifest["hybrid"]["fusion"] == "rrf"
    questions = [f"what is {p.title}?" for p in passages[:30]]
    results = hybrid.search(questions, 5)
    found = [p.id in {h.id for h in hits} for p, hits in zip(passages[:30], results, strict=True)]
    assert np.mean(found) >= 0.9
    assert all(len(hits) == 5 for hits in results)
    again = build_hybrid(path, hybrid.folder, HybridConfig(depth=20), overwrite=True)
    assert again.search(questions[:1], 5) == results[:1]  # a hybrid and its parts are ours
