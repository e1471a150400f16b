"""Output folders: what memsearcher may delete there, and locks that say a folder is in use.

Nothing we run deletes what we did not write. A command that replaces or clears an output
folder first lists it and refuses, naming what it found, unless every entry is recognisably its
own (:func:`check_replaceable`); the demo's run folder and index folders both go through it.
A name alone does not make an entry ours: a folder is the demo's only if its marker file
(:data:`MARKER`, written before anything else) says so (:func:`claim_folder`), and an index
folder only if its manifest does.

Locks are POSIX advisory locks (``flock``): the kernel drops them when their process dies, so a
lock that can be taken means nobody is working there any more, however that process ended.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from memsearcher.errors import MemSearcherError

__all__ = [
    "MARKER",
    "check_output_file",
    "check_replaceable",
    "claim_folder",
    "clear_folder",
    "exclusive",
    "try_lock",
]

MARKER = ".memsearcher.json"
"""The file that says which command made a folder: ``{"writer": "demo"}``."""


def check_output_file(
    path: Path, overwrite: bool, inputs: Sequence[Path] = (), flag: str = "--out"
) -> None:
    """Raise unless ``path`` may be written as one file: not a folder, not an input (nor inside
    an input folder), and new unless ``overwrite``. ``inputs`` are the ``--data`` paths read."""
    if path.is_dir():
        raise MemSearcherError(f"{flag} {path} is a folder; name the file to write")
    target = path.resolve()
    for source in inputs:
        if target == source.resolve():
            raise MemSearcherError(f"{flag} {path} is the input --data; choose another file")
        if source.is_dir() and target.is_relative_to(source.resolve()):
            raise MemSearcherError(
                f"{flag} {path} is inside the input --data {source}; choose a file outside it"
            )
    if path.exists() and not overwrite:
        raise MemSearcherError(f"{path} exists; choose another {flag} or pass --overwrite")


def check_replaceable(
    folder: Path, owned: Callable[[str], bool], what: str, flag: str = "--out"
) -> None:
    """Raise unless ``folder`` is absent or a real folder whose every entry ``owned`` accepts.

    ``what`` names the writer in the message ("a demo run", "an index build").
    """
    if folder.is_symlink():
        raise MemSearcherError(
            f"{flag} {folder} is a symbolic link; name the folder itself, or another one"
        )
    if folder.exists() and not folder.is_dir():
        raise MemSearcherError(f"{flag} {folder} is a file, not a folder; choose a folder")
    if not folder.is_dir():
        return
    foreign = sorted(entry.name for entry in folder.iterdir() if not owned(entry.name))
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise MemSearcherError(
            f"{flag} {folder} holds files that {what} does not write "
            f"({', '.join(foreign[:5])}{more}); nothing was deleted: choose another folder"
        )


def clear_folder(folder: Path, owned: Callable[[str], bool], what: str) -> None:
    """Empty ``folder`` after :func:`check_replaceable` found only ``owned`` entries in it."""
    check_replaceable(folder, owned, what)
    if not folder.is_dir():
        return
    for path in folder.iterdir():
        remove(path)


def claim_folder(
    folder: Path,
    writer: str,
    what: str,
    owned: Callable[[str], bool],
    overwrite: bool,
    flag: str = "--out",
) -> None:
    """Make ``folder`` ``writer``'s own, empty but for its marker, or raise and touch nothing.

    A new or empty folder is taken. A folder whose :data:`MARKER` names ``writer`` is emptied
    with ``overwrite``, if nothing beside the marker fails ``owned``; anything else is refused.
    ``what`` names the writer in messages ("a demo run").
    """
    check_replaceable(folder, lambda name: True, what, flag)  # refuses a link or a file
    if folder.is_dir() and any(folder.iterdir()):
        if not _marked_by(folder, writer):
            raise MemSearcherError(
                f"{flag} {folder} is not empty and was not made by {what} (it has no {MARKER} "
                "naming it); nothing was deleted: choose a new or empty folder"
            )
        if not overwrite:
            raise MemSearcherError(
                f"{flag} {folder} holds {what} made earlier; pass --overwrite to replace it, "
                "or choose another folder"
            )
        clear_folder(folder, lambda name: name == MARKER or owned(name), what)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).write_text(json.dumps({"writer": writer}) + "\n", encoding="utf-8")


def _marked_by(folder: Path, writer: str) -> bool:
    try:
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("writer") == writer


def remove(path: Path) -> None:
    """Delete a file or a folder tree; a symbolic link is removed, never followed."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def try_lock(path: Path) -> int | None:
    """An exclusive lock on ``path`` (a folder, or a file created if missing), as an open file
    descriptor to ``os.close`` when done; None if another process holds it."""
    flags = os.O_RDONLY if path.is_dir() else os.O_RDWR | os.O_CREAT
    fd = os.open(path, flags, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


@contextlib.contextmanager
def exclusive(path: Path, busy: str) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` for the ``with`` block; if another process holds it,
    raise :class:`MemSearcherError` with the message ``busy``."""
    fd = try_lock(path)
    if fd is None:
        raise MemSearcherError(busy)
    try:
        yield
    finally:
        os.close(fd)
