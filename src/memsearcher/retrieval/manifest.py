"""Index folders: a ``manifest.json`` that says what the folder holds and which corpus it indexes.

Every index folder has the manifest, the byte offsets of its passages in the corpus
(``offsets.npy``), and the library's own files. Loading checks that the corpus is still the one
the index was built from (same size, same sampled hash, same row count) before it serves a
single passage, because a silently swapped corpus returns wrong text for every hit.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from memsearcher.errors import MemSearcherError
from memsearcher.retrieval.corpus import CorpusError, PassageStore, fingerprint

MANIFEST = "manifest.json"
OFFSETS = "offsets.npy"
FORMAT = 1


class IndexFolderError(MemSearcherError):
    """An index folder is missing, unreadable, or of an unknown kind."""


def corpus_record(corpus: Path, rows: int, folder: Path) -> dict[str, Any]:
    """What the manifest stores about the corpus: where it is and how to recognise it."""
    corpus = corpus.resolve()
    return {
        "path": str(corpus),
        "relpath": os.path.relpath(corpus, folder.resolve()),
        "rows": rows,
        **fingerprint(corpus),
    }


def new_manifest(kind: str, **fields: Any) -> dict[str, Any]:
    from memsearcher import __version__

    return {
        "format": FORMAT,
        "kind": kind,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "memsearcher_version": __version__,
        **fields,
    }


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    tmp = folder / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, folder / MANIFEST)


def read_manifest(folder: str | Path) -> dict[str, Any]:
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        what = "no such folder" if not folder.exists() else f"no {MANIFEST} in it"
        raise IndexFolderError(f"not an index folder: {folder} ({what})")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise IndexFolderError(f"unreadable manifest {path}: {error}") from None
    if not isinstance(manifest, dict) or "kind" not in manifest:
        raise IndexFolderError(f"{path} is not an index manifest")
    if manifest.get("format", FORMAT) > FORMAT:
        raise IndexFolderError(
            f"{path} has format {manifest['format']}; this memsearcher reads up to {FORMAT}"
        )
    return manifest


def locate_corpus(folder: Path, manifest: dict[str, Any], corpus: str | Path | None) -> Path:
    """The corpus file of an index: ``corpus`` if given, else the recorded absolute path, else
    the recorded path relative to the index folder (for indexes moved along with their corpus)."""
    record = manifest["corpus"]
    candidates = [Path(corpus)] if corpus is not None else []
    candidates += [Path(record["path"]), folder / record["relpath"]]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise CorpusError(
        f"the corpus of index {folder} is gone: looked for "
        + ", ".join(str(c) for c in candidates)
        + " (pass the corpus path to load the index against a moved corpus)"
    )


def open_store(folder: Path, manifest: dict[str, Any], corpus: str | Path | None) -> PassageStore:
    """Open the passages of an index, after checking the corpus is the one it was built from."""
    path = locate_corpus(folder, manifest, corpus)
    record = manifest["corpus"]
    found = fingerprint(path)
    if found != {"size": record["size"], "sample_hash": record["sample_hash"]}:
        raise CorpusError(
            f"corpus {path} does not match index {folder}: it was built from a file of "
            f"{record['size']} bytes (hash {record['sample_hash']}), this one has "
            f"{found['size']} bytes (hash {found['sample_hash']}); rebuild the index"
        )
    offsets = np.load(folder / OFFSETS, mmap_mode="r")
    if len(offsets) != record["rows"]:
        raise CorpusError(
            f"index {folder} is damaged: {len(offsets)} passage offsets for "
            f"{record['rows']} corpus rows"
        )
    return PassageStore(path, offsets)


@contextlib.contextmanager
def building(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Build an index in a temporary sibling folder and move it to ``out`` only when complete, so
    a crash or two concurrent builds never leave a half-written index behind."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise IndexFolderError(f"{out} already exists (pass overwrite to replace it)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".building", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; an index is as readable as any other output
    try:
        yield tmp
        if out.exists():
            if not overwrite:  # another process finished the same build first
                return
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
