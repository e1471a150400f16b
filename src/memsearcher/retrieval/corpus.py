"""Passage corpora in JSONL: the wiki-18 format of Search-R1/FlashRAG, and a title/text variant.

One passage per line, either ``{"id": str, "contents": "\\"Title\\"\\ntext"}`` or
``{"id": str, "title": str, "text": str}``. Ids may also be integers (some dumps use them); they
become strings. Blank lines are skipped. Anything else is a malformed row, reported with its file
and line number. Text is passed through :func:`memsearcher.text.sanitize_text` as it is read.
A corpus must hold at least one passage, and its ids must be unique (a hit names its passage by
id), so both are checked when the corpus is scanned.

Indexes do not copy the text: they keep each passage's byte offset in the corpus file and read
passages back by offset (:class:`PassageStore`), so a 21M-passage corpus costs 8 bytes
per passage in memory, not its 13 GB of text.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from memsearcher.errors import MemSearcherError
from memsearcher.text import parse_json, sanitize_text
from memsearcher.types import Hit

logger = logging.getLogger(__name__)

OnError = Literal["raise", "skip"]


class CorpusError(MemSearcherError):
    """A corpus file is missing, malformed, or no longer matches an index built from it."""


@dataclass(frozen=True)
class Passage:
    """One corpus passage."""

    id: str
    title: str
    text: str

    @property
    def contents(self) -> str:
        """The passage in wiki-18 form: a quoted title line, then the text."""
        return f'"{self.title}"\n{self.text}'

    def to_hit(self, score: float = 0.0) -> Hit:
        return Hit(id=self.id, title=self.title, text=self.text, score=score)


def split_contents(contents: str) -> tuple[str, str]:
    """Title and text of a wiki-18 ``contents`` field.

    The first line is the title, with one pair of surrounding double quotes removed; the rest is
    the text. Without a newline there is no title and all of it is text.
    """
    head, sep, rest = contents.partition("\n")
    if not sep:
        return "", contents.strip()
    title = head.strip()
    if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
        title = title[1:-1]
    return title.strip(), rest.strip()


def parse_row(line: bytes | str, where: str = "<row>") -> Passage:
    """Parse one JSONL row; raise :class:`CorpusError` naming ``where`` if it is malformed."""
    try:
        if isinstance(line, bytes):
            line = line.decode("utf-8")
        row: Any = parse_json(line)
    except UnicodeDecodeError as error:
        raise CorpusError(f"{where}: not valid UTF-8 ({error.reason})") from None
    except ValueError as error:
        raise CorpusError(f"{where}: {error}") from None
    if not isinstance(row, dict):
        raise CorpusError(f"{where}: expected a JSON object, got {type(row).__name__}")
    pid = row.get("id", row.get("_id"))
    if isinstance(pid, bool) or not isinstance(pid, (str, int)):
        raise CorpusError(f'{where}: "id" must be a string or an integer, got {pid!r:.40}')
    if "contents" in row:
        contents = row["contents"]
        if not isinstance(contents, str):
            raise CorpusError(f'{where}: "contents" must be a string')
        title, text = split_contents(contents)
    elif "text" in row:
        title, text = row.get("title", ""), row["text"]
        if not isinstance(title, str) or not isinstance(text, str):
            raise CorpusError(f'{where}: "title" and "text" must be strings')
        title, text = title.strip(), text.strip()
    else:
        raise CorpusError(f'{where}: needs "contents", or "title" and "text"')
    return Passage(id=sanitize_text(str(pid)), title=sanitize_text(title), text=sanitize_text(text))


def check_corpus_path(path: str | Path) -> Path:
    """``path`` as a Path, if it is a corpus file; a clear error if it is missing or a folder."""
    path = Path(path)
    if path.is_dir():
        raise CorpusError(f"corpus {path} is a folder; pass the JSONL file inside it")
    if not path.is_file():
        raise CorpusError(f"corpus file not found: {path}")
    return path


def scan_corpus(path: str | Path, on_error: OnError = "raise") -> Iterator[tuple[int, Passage]]:
    """Stream ``(byte offset, passage)`` for every row of a JSONL corpus.

    ``on_error="raise"`` stops at the first malformed row; ``"skip"`` logs it and goes on (the
    skipped rows are then absent from any index built from the stream). Once the last row is
    read, a corpus without passages, or with an id used twice, is an error in either mode: ids
    are kept as 8-byte hashes (168 MB for wiki-18's 21M rows, not gigabytes of strings), and a
    repeated hash is confirmed on the text before it is reported.
    """
    path = check_corpus_path(path)
    hashes = array("q")
    offset = 0
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            start, offset = offset, offset + len(line)
            if not line.strip():
                continue
            try:
                passage = parse_row(line, f"{path}:{number}")
            except CorpusError as error:
                if on_error == "raise":
                    raise
                logger.warning("skipping malformed row: %s", error)
                continue
            hashes.append(hash(passage.id))
            yield start, passage
    if not hashes:
        raise CorpusError(f"corpus {path} holds no passages")
    _check_unique_ids(path, hashes)


def _check_unique_ids(path: Path, hashes: array) -> None:
    ordered = np.sort(np.frombuffer(hashes, dtype=np.int64))
    repeated = set(ordered[1:][ordered[1:] == ordered[:-1]].tolist())
    if not repeated:
        return
    lines: dict[str, list[int]] = {}  # a second pass, on this error path only
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            try:
                pid = parse_row(line, "").id if line.strip() else None
            except CorpusError:
                continue
            if pid is not None and hash(pid) in repeated:
                lines.setdefault(pid, []).append(number)
    twice = {pid: numbers for pid, numbers in lines.items() if len(numbers) > 1}
    if twice:
        pid, numbers = next(iter(twice.items()))
        raise CorpusError(
            f"{path}: passage id {pid!r} is used more than once (lines "
            f"{', '.join(map(str, numbers[:5]))}); {len(twice)} id(s) repeat in all, and ids "
            "must be unique"
        )


def read_corpus(path: str | Path, on_error: OnError = "raise") -> Iterator[Passage]:
    """Stream the passages of a JSONL corpus (see :func:`scan_corpus`)."""
    for _, passage in scan_corpus(path, on_error):
        yield passage


def write_corpus(path: str | Path, passages: Iterator[Passage] | list[Passage]) -> int:
    """Write passages as wiki-18 JSONL, atomically (temp file, then rename). Returns the count."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    count = 0
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for p in passages:
                f.write(json.dumps({"id": p.id, "contents": p.contents}, ensure_ascii=False))
                f.write("\n")
                count += 1
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return count


def fingerprint(path: str | Path) -> dict[str, Any]:
    """A cheap identity of a corpus file: its size and a hash of sampled blocks.

    Hashing all of wiki-18 (13 GB) on every load would take minutes; the first and last MiB and
    64 evenly spaced 4 KiB blocks catch a replaced, truncated or re-generated file.
    """
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.blake2b(digest_size=16)
    with path.open("rb") as f:
        spans = [(0, 1 << 20), (max(0, size - (1 << 20)), 1 << 20)]
        spans += [(size * k // 64, 4096) for k in range(1, 64)]
        for start, length in spans:
            f.seek(start)
            digest.update(f.read(length))
    return {"size": size, "sample_hash": digest.hexdigest()}


class PassageStore:
    """Random access to a corpus by row number, through saved byte offsets.

    Rows are read with ``os.pread``, not through a memory map: a map of a file that is then
    truncated kills the process with SIGBUS on the next read past the new end, with no chance to
    log. Before each lookup the open file's size and mtime are compared with those seen at
    opening (one ``os.fstat``), and a corpus rewritten in place since then is a
    :class:`CorpusError`: the index's offsets no longer point at its passages. A corpus
    replaced by a rename leaves the opened file as it was, and the index keeps reading the
    passages it was built from.
    """

    def __init__(self, corpus: str | Path, offsets: np.ndarray) -> None:
        self.path = Path(corpus)
        self.offsets = offsets
        self._fd: int | None = os.open(self.path, os.O_RDONLY)
        self._seen = _identity(os.fstat(self._fd))

    def __len__(self) -> int:
        return len(self.offsets)

    def check(self) -> None:
        """Raise :class:`CorpusError` if the corpus file changed since the store opened it."""
        if self._fd is None:
            raise CorpusError(f"passage store of {self.path} is closed")
        if _identity(os.fstat(self._fd)) != self._seen:
            raise CorpusError(
                f"corpus {self.path} was rewritten after it was opened (its size or mtime "
                "changed): its passages can no longer be read; restore the file, or rebuild "
                "the index and restart"
            )

    def raw(self, row: int) -> bytes:
        """The JSON line of passage ``row``, without its newline."""
        if self._fd is None:
            raise CorpusError(f"passage store of {self.path} is closed")
        start = int(self.offsets[row])
        # a row ends before the next row starts (or at the end of the file)
        end = int(self.offsets[row + 1]) if row + 1 < len(self.offsets) else self._seen[0]
        return os.pread(self._fd, end - start, start).partition(b"\n")[0]

    def get(self, row: int) -> Passage:
        self.check()
        return self._parse(row)

    def hits(self, rows: np.ndarray | list[int], scores: np.ndarray | list[float]) -> list[Hit]:
        self.check()
        return [self._parse(int(r)).to_hit(float(s)) for r, s in zip(rows, scores, strict=True)]

    def _parse(self, row: int) -> Passage:
        return parse_row(self.raw(row), f"{self.path}: passage {row}")

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _identity(stat: os.stat_result) -> tuple[int, int]:
    return stat.st_size, stat.st_mtime_ns
