"""Two-stage dense retrieval: IVF-PQ candidates re-ranked exactly from float16 vectors on disk.

Real passages (sentences of the embedded Wikipedia summaries) encoded with the packaged
all-MiniLM-L6-v2; the server test runs the real CLI server on 127.0.0.1 with two workers.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from _servers import free_port, running

from memsearcher.cli import main
from memsearcher.retrieval.corpus import Passage, write_corpus
from memsearcher.retrieval.dense import (
    EMBEDDINGS_FILE,
    RERANK_NPROBE,
    DenseIndex,
    FaissConfig,
    _make_faiss,
    build_dense,
    embeddings_of,
)
from memsearcher.retrieval.embedded import embedded_passages
from memsearcher.retrieval.manifest import IndexFolderError
from memsearcher.retrieval.rerank import RERANK_FILE, rerank, smaps_of

PASSAGES = 1000
# 1,000 vectors: 8 clusters, all probed, so the candidates' quality is the PQ codes'
SMALL = FaissConfig(kind="ivfpq", nlist=8, nprobe=8, pq_m=48, rerank=True, threads=1)


def sentences(n: int) -> list[Passage]:
    """Sentences of the summaries, 2 from each of the first n/2 summaries: real, short text
    with near neighbours (two sentences about the same subject)."""
    out: list[Passage] = []
    for p in embedded_passages():
        parts = [s for s in p.text.split(". ") if len(s) > 20][:2]
        out += [
            Passage(str(len(out) + i), p.title, s.rstrip(".") + ".") for i, s in enumerate(parts)
        ]
        if len(out) >= n:
            return out[:n]
    return out


@pytest.fixture(scope="module")
def indexes(tmp_path_factory: pytest.TempPathFactory) -> tuple[DenseIndex, DenseIndex]:
    root = tmp_path_factory.mktemp("rerank")
    write_corpus(root / "corpus.jsonl", sentences(PASSAGES))
    flat = build_dense(root / "corpus.jsonl", root / "flat", keep_embeddings=True)
    two = build_dense(root / "corpus.jsonl", root / "two", index=SMALL, embeddings_from=flat.folder)
    return flat, two


def known_items(n: int = 100) -> list[str]:
    """Each query is a passage's own text, so each has one known source passage."""
    return [p.text for p in sentences(PASSAGES)[:: PASSAGES // n]]


def ids(results: list[Any]) -> list[list[str]]:
    return [[h.id for h in hits] for hits in results]


def test_rerank_by_hand() -> None:
    embeddings = np.array([[1, 0], [0, 1], [0.6, 0.8], [-1, 0]], dtype=np.float16)
    queries = np.array([[1, 0], [0, 1]], dtype=np.float32)
    candidates = np.array([[3, 2, 0], [0, -1, 2]])
    rows, scores = rerank(embeddings, queries, candidates, 2)
    assert rows.tolist() == [[0, 2], [2, 0]]
    assert scores.ravel().tolist() == pytest.approx([1.0, 0.6, 0.7998, 0.0], abs=1e-3)
    rows, scores = rerank(embeddings, queries, candidates, 3)
    assert rows[1].tolist() == [2, 0, -1] and scores[1, 2] == -np.inf  # -1 pads


def test_top5_equals_flat_on_known_items(indexes: tuple[DenseIndex, DenseIndex]) -> None:
    flat, two = indexes
    queries = known_items()
    vectors = flat.encoder.queries(queries)
    truth = [r.tolist() for r, _ in flat.search_vectors(vectors, 5)]
    assert [r.tolist() for r, _ in two.search_vectors(vectors, 5)] == truth
    # without re-ranking the same codes miss flat's top 5: the second stage is what does it
    codes_only = replace(two, index=two.index.base_index, refine=None)
    alone = [r.tolist() for r, _ in codes_only.search_vectors(vectors, 5)]
    overlap = np.mean([len(set(a) & set(t)) / 5 for a, t in zip(alone, truth, strict=True)])
    assert overlap < 0.9
    # FAISS's refine stage equals the numpy gather-and-dot over the memory map
    _, candidates = two.index.base_index.search(vectors, SMALL.candidates)
    rows, _ = rerank(embeddings_of(two.folder), vectors, candidates, 5)
    assert rows.tolist() == truth


def test_ivfpq_skips_polysemous_training() -> None:
    """index_factory trains polysemous codes for 8-bit PQ unless told not to: minutes of
    simulated annealing for a search mode we never use."""
    import faiss

    for opq in (False, True):
        made = _make_faiss(FaissConfig(kind="ivfpq", opq=opq), 384, 20_000)
        ivf: Any = faiss.downcast_index(faiss.extract_index_ivf(made))
        assert not ivf.do_polysemous_training


def test_manifest_memory_and_settings(indexes: tuple[DenseIndex, DenseIndex]) -> None:
    flat, two = indexes
    record = two.manifest["dense"]
    assert record["faiss"]["rerank"] and record["kept_embeddings"]
    memory = record["memory"]
    assert memory["resident_bytes_per_passage"] == 48 + 8 + 8  # code, id, corpus offset
    assert memory["disk_bytes"] == memory["resident_bytes"] + memory["rerank_file_bytes"]
    assert memory["rerank_file_bytes"] == (two.folder / RERANK_FILE).stat().st_size
    assert not (two.folder / EMBEDDINGS_FILE).exists()  # moved into the re-rank file, not copied
    assert np.array_equal(embeddings_of(two.folder), embeddings_of(flat.folder))
    again = build_dense(  # other variants from a re-ranking index's embeddings, no encoding
        flat.store.path,
        two.folder.parent / "again",
        embeddings_from=two.folder,
        keep_embeddings=True,
    )
    assert np.array_equal(embeddings_of(again.folder), embeddings_of(flat.folder))
    assert DenseIndex.load(two.folder, candidates=7).search_params["candidates"] == 7


def test_cli_builds_a_reranking_index(
    indexes: tuple[DenseIndex, DenseIndex], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flat, _ = indexes
    out = tmp_path / "cli"
    command = ["index", "build", "--corpus", str(flat.store.path), "--out", str(out), "--kind",
               "dense", "--faiss", "ivfpq", "--rerank", "--candidates", "30", "--nlist", "8",
               "--embeddings-from", str(flat.folder), "--no-progress"]  # fmt: skip
    assert main(command) == 0
    assert main(["index", "info", str(out)]) == 0
    record = json.loads(capsys.readouterr().out.split("\n", 1)[1])["dense"]  # after "built ..."
    assert record["faiss"]["rerank"] and record["faiss"]["candidates"] == 30
    assert record["faiss"]["nprobe"] == RERANK_NPROBE  # the re-ranking default, recorded
    assert record["memory"]["resident_bytes_per_passage"] == 64
    assert (out / RERANK_FILE).is_file()
    with pytest.raises(IndexFolderError, match="rerank applies to ivfpq"):
        FaissConfig(kind="hnsw", rerank=True)


def test_server_workers_share_the_map_within_the_bound(
    indexes: tuple[DenseIndex, DenseIndex], tmp_path: Path
) -> None:
    flat, two = indexes
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "memsearcher.cli", "retriever", "serve", "--index",
               str(two.folder), "--port", str(port), "--workers", "2", "--mmap"]  # fmt: skip
    env = {**os.environ, "MEMSEARCHER_HOME": str(tmp_path / "home"), "OMP_NUM_THREADS": "1"}
    queries = known_items(40)
    with running(command, f"{url}/health", tmp_path / "server.log", env):
        answer = httpx.post(f"{url}/batch_search", json={"query": queries, "top_n": 5}, timeout=60)
        assert answer.status_code == 200
        assert [[d["id"] for d in docs] for docs in answer.json()] == ids(flat.search(queries, 5))
        retrieved = httpx.post(f"{url}/retrieve", json={"queries": queries[:3], "topk": 2})
        assert [[r["document"]["id"] for r in q] for q in retrieved.json()["result"]] == [
            i[:2] for i in ids(flat.search(queries[:3], 5))
        ]
        workers: dict[int, dict[str, Any]] = {}
        for _ in range(40):
            memory = httpx.get(f"{url}/health", timeout=10).json()["memory"]
            workers[memory["pid"]] = memory
            if len(workers) == 2:
                break
        file = two.folder / RERANK_FILE
        print(workers)  # the measured figures, for the log
        for pid, memory in workers.items():
            assert memory["resident_bytes_per_passage"] <= 100
            # the index's own load took about its resident size, not the re-rank file's size
            assert memory["load_rss_anon_bytes"] < memory["resident_bytes"] + (1 << 18)
            mapped = smaps_of(pid, file)
            assert mapped["mappings"] >= 1 and mapped["anonymous"] == 0  # shared, no copy
            assert memory["rerank_file_private_bytes"] == 0
            assert 0 < mapped["rss"] <= file.stat().st_size + 4096  # whole pages
