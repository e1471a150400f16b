"""A real headless Chromium for the page tests: Debian's ``chromium`` package, driven by
Playwright (``playwright`` in the test extra; its own browsers are never downloaded).

``scripts/setup.sh --dev`` installs the browser. Where it is missing the tests fail and say
how to install it: a page that was never opened in a browser is not tested.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

# What the machines' probe found Chromium needs here: without the networking flags it keeps
# trying to reach Google's hosts, and the closed network refuses it, many times a second.
FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def chromium_path() -> str:
    path = os.environ.get("MEMSEARCHER_CHROMIUM") or shutil.which("chromium")
    if path is None:
        pytest.fail(
            "Chromium is not installed, so the pages cannot be tested: `apt-get install "
            "chromium` (scripts/setup.sh --dev does), or set MEMSEARCHER_CHROMIUM to a "
            "Chromium or Chrome binary",
            pytrace=False,
        )
    return path


@contextmanager
def browser() -> Iterator[Any]:
    """A headless Chromium; a test opens its pages with ``browser.new_page()``."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as error:
        pytest.fail(f"playwright is not installed (pip install -e '.[test]'): {error}")
    executable = chromium_path()
    with sync_playwright() as driver:
        chromium = driver.chromium.launch(executable_path=executable, args=FLAGS, headless=True)
        try:
            yield chromium
        finally:
            chromium.close()
