"""Output folders: what memsearcher may delete there, and locks that say a folder is in use.

Nothing we run deletes what we did not write. A command that replaces or clears an output
folder first lists it and refuses, naming what it found, unless every entry is recognisably its
own (:func:`check_replaceable`); the demo's run folder and index folders both go through it.

Locks are POSIX advisory locks (``flock``): the kernel drops them when their process dies, so a
lock that can be taken means nobody is working there any more, however that process ended.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from memsearcher.errors import MemSearcherError

__all__ = ["check_replaceable", "clear_folder", "exclusive", "try_lock"]


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
