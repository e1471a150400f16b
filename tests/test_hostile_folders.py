"""Commands pointed at folders and files they did not write: each refuses, names the path and
what to do, and loses nothing (issue 26). Every command runs for real, on real files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from memsearcher.errors import MemSearcherError
from memsearcher.folders import MARKER, claim_folder


def user_folder(root: Path) -> dict[Path, str]:
    """A user's work, under names the demo also writes."""
    files = {
        root / "models" / "my-finetune" / "model.safetensors": "weights",
        root / "eval" / "results.csv": "em,0.5",
        root / "report.md": "# my report",
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return files


def demo(out: Path, *extra: str, wait: float = 60.0) -> tuple[int | None, str]:
    """Run ``memsearcher demo --quick --out OUT``; kill it if it is still running after
    ``wait`` seconds (a refusal takes a second or two) and return its exit code (None if
    killed) and stderr."""
    command = [sys.executable, "-m", "memsearcher.cli", "demo", "--quick", "--out", str(out)]
    with subprocess.Popen([*command, *extra], stderr=subprocess.PIPE, text=True) as process:
        try:
            _, err = process.communicate(timeout=wait)
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate()
            return None, err
    return process.returncode, err


def test_demo_refuses_a_users_folder_under_names_it_writes(tmp_path: Path) -> None:
    files = user_folder(tmp_path / "work")
    for extra in ((), ("--overwrite",)):
        code, err = demo(tmp_path / "work", *extra)
        assert code == 2, err[-2000:]
        assert f"{tmp_path / 'work'} is not empty and was not made by a demo run" in err
        assert {path: path.read_text() for path in files} == files


def test_demo_replaces_only_a_folder_it_marked_and_only_with_overwrite(tmp_path: Path) -> None:
    out = tmp_path / "run"
    claim_folder(out, "demo", "a demo run", lambda name: name in {"models", "report.md"}, False)
    assert (out / MARKER).is_file()
    (out / "models" / "init").mkdir(parents=True)
    (out / "report.md").write_text("old report")
    code, err = demo(out)  # an earlier run: replaced only when asked
    assert code == 2 and "holds a demo run made earlier; pass --overwrite" in err, err[-2000:]
    assert (out / "report.md").read_text() == "old report"
    (out / "notes.txt").write_text("mine")  # the user's, beside the demo's files
    code, err = demo(out, "--overwrite")
    assert code == 2 and "(notes.txt)" in err and "nothing was deleted" in err, err[-2000:]
    assert (out / "report.md").read_text() == "old report"
    assert (out / "notes.txt").read_text() == "mine"

    (out / "notes.txt").unlink()
    owned = {"models", "report.md"}
    claim_folder(out, "demo", "a demo run", lambda name: name in owned, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [MARKER]
    with pytest.raises(MemSearcherError, match="is a symbolic link"):
        (tmp_path / "link").symlink_to(out)
        claim_folder(tmp_path / "link", "demo", "a demo run", lambda name: True, True)
