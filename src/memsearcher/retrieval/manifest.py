"""Index folders: a ``manifest.json`` that says what the folder holds and which corpus it indexes.

Every index folder has the manifest, the byte offsets of its passages in the corpus
(``offsets.npy``), and the library's own files. Loading checks that the corpus is still the one
the index was built from (same size, same sampled hash, same row count) before it serves a
single passage, because a silently swapped corpus returns wrong text for every hit.

The manifest also lists the files the build wrote (``files``). That list is what makes a folder
recognisably an index: ``overwrite`` replaces a folder only if its manifest is ours (a format
this memsearcher reads, a version, a kind it builds) and nothing lies beside it but what that
kind writes (:data:`KIND_FILES`), and never deletes anything before the new index is complete.
A manifest's word alone deletes nothing: a ``files`` list naming a user's file does not make it
ours.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from memsearcher.errors import MemSearcherError
from memsearcher.folders import check_replaceable, try_lock
from memsearcher.retrieval.corpus import CorpusError, PassageStore, fingerprint

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
OFFSETS = "offsets.npy"
FORMAT = 1
STAGING = ".building"
"""Suffix of the hidden sibling folder an index is built in."""
STAGING_MARK = ".building.lock"
"""A file in a staging folder, created once its builder holds the folder's lock."""
REPLACED = ".replaced"
"""Suffix of an old index moved aside by an overwrite until the new one is in place."""
LEGACY_FILES = frozenset({OFFSETS, "bm25s", "bm25", "dense", "index.faiss", "embeddings.f16"})
"""What builds wrote before manifests listed their files."""
KIND_FILES = {
    "bm25": frozenset({OFFSETS, "bm25s", "bm25"}),
    "dense": frozenset({OFFSETS, "index.faiss", "embeddings.f16", "rerank.faiss"}),
    "hybrid": frozenset({"bm25", "dense"}),
}
"""Every name a build of each kind may write beside its manifest (``bm25`` is the BM25
library's folder of early builds; a hybrid's are its two parts, index folders of their own)."""


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
    """Write the manifest last, listing every file the build put in ``folder``."""
    internal = {MANIFEST, STAGING_MARK, f".{MANIFEST}.tmp"}
    files = sorted(p.name for p in folder.iterdir() if p.name not in internal)
    manifest = {**manifest, "files": files}
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
    form = manifest.get("format", FORMAT)
    if type(form) is not int or form > FORMAT:
        raise IndexFolderError(f"{path} has format {form!r}; this memsearcher reads up to {FORMAT}")
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


def check_overwritable(out: Path, kind: str | None = None) -> None:
    """Raise unless ``out`` is absent or an index folder we built (of ``kind``, if given): a
    manifest we wrote and, beside it, only files its kind writes and it lists."""
    if not out.is_dir() or out.is_symlink():
        check_replaceable(out, lambda name: False, "an index build")
        return
    names = {p.name for p in out.iterdir()}
    if not names:
        return
    if MANIFEST not in names:
        check_replaceable(out, lambda name: False, "an index build")  # raises: it is not ours
    try:
        manifest = read_manifest(out)
        _check_ours(out / MANIFEST, manifest, kind)
    except IndexFolderError as error:
        raise IndexFolderError(f"{error}; not replacing {out}, nothing was deleted") from None
    files = manifest.get("files")
    ours = KIND_FILES[manifest["kind"]]
    listed = ours & set(files) if isinstance(files, list) else ours
    check_replaceable(out, lambda name: name == MANIFEST or name in listed, "an index build")
    if manifest["kind"] == "hybrid":
        for part in listed & names:
            check_overwritable(out / part, kind=part)


def _check_ours(path: Path, manifest: dict[str, Any], kind: str | None) -> None:
    """Raise unless ``manifest`` is one a build of ours wrote: a format we read, a version, and
    a kind we build (``kind``, if given)."""
    form, version = manifest.get("format"), manifest.get("memsearcher_version")
    if type(form) is not int or not 1 <= form <= FORMAT or not isinstance(version, str):
        raise IndexFolderError(f"{path} was not written by memsearcher (no format or version)")
    if manifest["kind"] not in KIND_FILES or manifest["kind"] != (kind or manifest["kind"]):
        wanted = kind or " or ".join(KIND_FILES)
        raise IndexFolderError(f"{path} names kind {manifest['kind']!r}, not {wanted}")


def looks_built(folder: Path) -> bool:
    """True if every entry of ``folder`` has a name index builds write (whatever the manifest
    says): how memsearcher recognises a damaged index in its own cache, and only there."""
    names = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
    return bool(names) and names <= LEGACY_FILES | {MANIFEST}


def _siblings(out: Path, suffix: str) -> list[Path]:
    prefix = f".{out.name}."
    return [
        p for p in out.parent.iterdir()
        if p.name.startswith(prefix) and p.name.endswith(suffix) and p.is_dir()
        and not p.is_symlink()
    ]  # fmt: skip


def remove_abandoned(out: Path) -> None:
    """Delete what killed builds of ``out`` left behind: staging folders whose builder is gone
    (their lock can be taken), and old indexes moved aside once ``out`` is complete again."""
    for folder in _siblings(out, STAGING):
        if not (folder / STAGING_MARK).is_file():
            continue  # not ours, or its builder has not taken the lock yet
        fd = try_lock(folder)
        if fd is None:
            continue  # a build is running there
        try:
            logger.warning("removing %s, left by a build that was killed", folder)
            shutil.rmtree(folder, ignore_errors=True)
        finally:
            os.close(fd)
    if (out / MANIFEST).is_file():
        for folder in _siblings(out, REPLACED):
            if (folder / MANIFEST).is_file():
                logger.warning("removing %s, an index an interrupted overwrite replaced", folder)
                shutil.rmtree(folder, ignore_errors=True)


def _move_in(tmp: Path, out: Path, overwrite: bool) -> None:
    """Put the finished ``tmp`` at ``out``; an old index is renamed aside first and deleted
    only once the new one is in place, so ``out`` never lacks a complete index for long."""
    if not out.exists():
        try:
            os.rename(tmp, out)
        except OSError:
            if not out.exists():
                raise
            # another process finished the same build first: its index stands
        return
    if not overwrite:  # another process finished the same build first
        return
    check_overwritable(out)
    # rename(2) replaces an empty folder, so the old index takes the name mkdtemp reserved
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=REPLACED, dir=out.parent))
    os.rename(out, aside)
    try:
        os.rename(tmp, out)
    except OSError:
        os.rename(aside, out)
        raise
    shutil.rmtree(aside, ignore_errors=True)


@contextlib.contextmanager
def building(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Build an index in a hidden sibling folder and move it to ``out`` only when complete, so
    a crash or two concurrent builds never leave a half-written index behind.

    ``overwrite`` replaces an existing index folder (see :func:`check_overwritable`); anything
    else at ``out`` is refused before the build starts, and again before it is replaced.
    """
    out = Path(os.path.abspath(out))  # "." and ".." have no name to build a sibling from
    if out.exists() or out.is_symlink():
        if not overwrite and out.is_dir() and not out.is_symlink():
            raise IndexFolderError(f"{out} already exists (pass overwrite to replace it)")
        check_overwritable(out)  # a file or a link is refused whatever overwrite says
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=STAGING, dir=out.parent))
    lock = try_lock(tmp)  # held until the build ends: the folder is in use while it is held
    assert lock is not None, tmp  # a folder mkdtemp just made is nobody else's
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; an index is as readable as any other output
        (tmp / STAGING_MARK).touch()
        yield tmp
        (tmp / STAGING_MARK).unlink()
        _move_in(tmp, out, overwrite)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        os.close(lock)
