"""`memsearcher index build|search|info`, run in-process through the real CLI entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from memsearcher.cli import main
from memsearcher.retrieval.corpus import Passage, write_corpus
from memsearcher.retrieval.embedded import embedded_passages
from memsearcher.retrieval.manifest import MANIFEST


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    passages = [Passage(p.id, p.title, p.text[:200]) for p in embedded_passages()[:400:10]]
    write_corpus(tmp_path / "corpus.jsonl", passages)
    return tmp_path / "corpus.jsonl"


def test_build_search_info_bm25(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bm25"
    code = main(["index", "build", "--corpus", str(corpus), "--out", str(out), "--no-progress"])
    assert code == 0
    assert "built bm25 index" in capsys.readouterr().out
    assert main(["index", "search", str(out), "Academy Awards film", "--top-n", "2"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# Academy Awards film\n") and "Doc 1 (Title: " in printed
    assert main(["index", "search", str(out), "zzqqxx", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"query": "zzqqxx", "hits": []}
    assert main(["index", "info", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["kind"] == "bm25"


def test_user_errors_exit_2(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = [
        "index",
        "build",
        "--corpus",
        str(tmp_path / "no.jsonl"),
        "--out",
        str(tmp_path / "x"),
    ]
    assert main(missing) == 2
    assert "corpus file not found" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1", "contents": "ok"}\n{"id": 2, "contents": null}\n')
    assert main(["index", "build", "--corpus", str(bad), "--out", str(tmp_path / "y")]) == 2
    assert f"{bad}:2:" in capsys.readouterr().err
    skip = ["index", "build", "--corpus", str(bad), "--out", str(tmp_path / "y"), "--skip-bad-rows"]
    assert main([*skip, "--no-progress"]) == 0
    assert main(["index", "search", str(tmp_path), "q"]) == 2
    assert "not an index folder" in capsys.readouterr().err
    assert main(["index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "z"),
                 "--method", "bm99"]) == 2  # fmt: skip


@pytest.mark.slow
def test_build_dense_with_progress_bar(corpus: Path, tmp_path: Path) -> None:
    """The real console script, as a user runs it: progress bars on stderr."""
    out = tmp_path / "dense"
    command = [sys.executable, "-m", "memsearcher.cli", "index", "build", "--corpus", str(corpus)]
    command += ["--out", str(out), "--kind", "dense", "--faiss", "hnsw", "--hnsw-m", "8"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "dense: encode" in done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert (
        manifest["dense"]["faiss"]["kind"] == "hnsw" and manifest["dense"]["faiss"]["hnsw_m"] == 8
    )
    search = [sys.executable, "-m", "memsearcher.cli", "index", "search", str(out), "a film"]
    found = subprocess.run(search, capture_output=True, text=True, timeout=300, check=False)
    assert found.returncode == 0 and "Doc 1 (Title: " in found.stdout


# -- what --overwrite may delete, and what a killed build leaves ---------------------------------


def build(corpus: Path, out: Path | str, *extra: str) -> int:
    return main(["index", "build", "--corpus", str(corpus), "--out", str(out), "--no-progress",
                 *extra])  # fmt: skip


def test_overwrite_replaces_an_index_it_built_and_nothing_else(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "u"
    (out / "thesis").mkdir(parents=True)
    (out / "thesis" / "a.tex").write_text("years of work")
    assert build(corpus, out, "--overwrite") == 2
    assert "holds files that an index build does not write (thesis)" in capsys.readouterr().err
    assert (out / "thesis" / "a.tex").read_text() == "years of work"

    index = tmp_path / "idx"
    assert build(corpus, index) == 0
    assert build(corpus, index) == 2  # exists, and no --overwrite
    assert build(corpus, index, "--overwrite") == 0  # an index we built: replaced
    (index / "notes.txt").write_text("mine")  # something of the user's beside it
    assert build(corpus, index, "--overwrite") == 2
    assert "(notes.txt)" in capsys.readouterr().err
    assert (index / "notes.txt").read_text() == "mine"
    (index / "notes.txt").unlink()
    (index / "manifest.json").write_text("{not json")  # not recognisably ours any more
    assert build(corpus, index, "--overwrite") == 2
    assert "nothing was deleted" in capsys.readouterr().err
    assert sorted(p.name for p in index.iterdir()) == ["bm25s", "manifest.json", "offsets.npy"]


def test_overwrite_trusts_no_forged_manifest(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ours = {"format": 1, "memsearcher_version": "0.1.0"}
    forged = {
        "dense": {"kind": "photos"},  # no format, no version, a kind no build writes
        "thesis.txt": {"kind": "bm25", "files": ["thesis.txt"]},
        "notes.txt": {**ours, "kind": "bm25", "files": ["notes.txt", "bm25s"]},
        "bm25": {**ours, "kind": "hybrid"},  # a hybrid's part that is no index
        "offsets.npy": {"format": "1", "kind": "bm25"},
    }
    for name, manifest in forged.items():
        folder = tmp_path / name.replace(".", "-")
        mine = folder / name
        if "." in name:
            mine.parent.mkdir(parents=True)
            mine.write_text("years of work")
        else:
            mine.mkdir(parents=True)
            (mine / "holiday.jpg").write_text("years of work")
        (folder / MANIFEST).write_text(json.dumps(manifest))
        assert build(corpus, folder, "--overwrite") == 2, name
        err = capsys.readouterr().err
        assert str(folder) in err and "nothing was deleted" in err, err
        kept = [p.read_text() for p in folder.rglob("*") if p.is_file() and p != folder / MANIFEST]
        assert kept == ["years of work"], name


def test_overwrite_of_the_working_directory_deletes_nothing(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    before = sorted(tmp_path.rglob("*"))
    monkeypatch.chdir(tmp_path)
    assert build(corpus, ".", "--overwrite") == 2
    assert build(corpus, "..", "--overwrite") == 2
    assert sorted(tmp_path.rglob("*")) == before


def test_unclear_errors_now_say_what_is_wrong(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert build(corpus, corpus, "--overwrite") == 2
    assert "is the corpus file" in capsys.readouterr().err
    note = tmp_path / "note.txt"
    note.write_text("keep")
    assert build(corpus, note, "--overwrite") == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    assert note.read_text() == "keep"
    assert build(tmp_path, tmp_path / "x") == 2
    assert "is a folder; pass the JSONL file" in capsys.readouterr().err


def test_duplicate_ids_and_empty_corpora_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    twice = tmp_path / "twice.jsonl"
    twice.write_text('{"id": "1", "contents": "a"}\n{"id": "2", "contents": "b"}\n'
                     '{"id": 1, "contents": "c"}\n')  # fmt: skip
    assert build(twice, tmp_path / "a") == 2
    assert "passage id '1' is used more than once (lines 1, 3)" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    assert build(empty, tmp_path / "b") == 2
    assert "holds no passages" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "1"}\n')
    assert build(bad, tmp_path / "c", "--skip-bad-rows") == 2  # nothing left once skipped
    assert not any(tmp_path.glob("[abc]")) and not any(tmp_path.glob(".*building"))


def test_a_killed_build_leaves_nothing_a_later_build_keeps(corpus: Path, tmp_path: Path) -> None:
    out = tmp_path / "idx"
    killed = (
        "import os, signal, sys\n"
        "from memsearcher.retrieval.manifest import building\n"
        "with building(sys.argv[1]) as tmp:\n"
        "    (tmp / 'half-written').write_text('x')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    done = subprocess.run([sys.executable, "-c", killed, str(out)], timeout=60, check=False)
    assert done.returncode == -9
    (left,) = tmp_path.glob(".idx.*.building")
    assert (left / "half-written").is_file()

    from memsearcher.retrieval.manifest import building

    live_out = tmp_path / "other"
    with building(live_out) as live:  # a build in progress, here, while another one starts
        (live / "part").write_text("x")
        assert build(corpus, out) == 0
        assert build(corpus, live_out.parent / "other2") == 0
        assert live.is_dir()  # not ours to remove: its builder holds the lock
        with building(live_out):  # even by a build of the same folder
            assert live.is_dir()
    assert not left.exists()
    assert not list(tmp_path.glob(".*.building"))


def test_overwrite_keeps_the_old_index_until_the_new_one_is_in(
    corpus: Path, tmp_path: Path
) -> None:
    from memsearcher.retrieval.manifest import building

    out = tmp_path / "idx"
    assert build(corpus, out) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(OSError), building(out, overwrite=True) as tmp:
        (tmp / "x").write_text("new")
        tmp.rename(tmp_path / "gone")  # the move of the new index into place will fail
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert main(["index", "search", str(out), "film"]) == 0


def test_index_search_survives_a_passage_with_a_lone_surrogate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "c.jsonl"
    # valid JSON (an escape), but not encodable as UTF-8 once decoded
    corpus.write_text('{"id": "s\\ud800", "contents": "\\"Lone \\udc00\\"\\nzebra \\ud83d x"}\n'
                      '{"id": "2", "contents": "\\"Two\\"\\nzebra crossing"}\n')  # fmt: skip
    assert build(corpus, tmp_path / "idx") == 0
    capsys.readouterr()
    assert main(["index", "search", str(tmp_path / "idx"), "zebra"]) == 0
    assert "Lone \ufffd" in capsys.readouterr().out
    assert main(["index", "search", str(tmp_path / "idx"), "zebra \udcff", "--json"]) == 0
    hits = json.loads(capsys.readouterr().out)["hits"]
    assert {h["id"] for h in hits} == {"s\ufffd", "2"}
