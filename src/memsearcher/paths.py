"""Where memsearcher keeps what it builds: converted models, corpora, indexes."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """The cache root: ``$MEMSEARCHER_HOME``, else ``~/.cache/memsearcher``."""
    root = os.environ.get("MEMSEARCHER_HOME")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "memsearcher"
