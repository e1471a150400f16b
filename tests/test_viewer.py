"""The trajectory viewer at ``/`` of ``memsearcher serve``, in a real headless Chromium
(tests/_browser.py) against the CLI's server on 127.0.0.1 with the embedded model and BM25
index, for MemSearcher and for ReAct.

The page must show what the server's own answer holds: a question typed into the box, each
turn as it streams with its context size and its memory (MemSearcher's rewritten memory;
"no memory" for ReAct, whose context grows), then the answer. The greedy agent gives the same
trajectory to the page's streamed request as to a plain ``POST /v1/answer``, so the page is
checked against that. The page may fetch nothing but its own server.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from _browser import browser
from _servers import free_port, running

pytestmark = pytest.mark.slow

QUESTION = "Who painted The Starry Night?"


@pytest.fixture(scope="module", params=["memsearcher", "react"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    port = free_port()
    command = [sys.executable, "-m", "memsearcher.cli", "serve", "--port", str(port)]
    command += ["--agent", request.param, "--max-turns", "3", "--max-new-tokens", "64"]
    command += ["--memory-tokens", "48", "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp_path_factory.mktemp("viewer") / f"{request.param}.log"
    url = f"http://127.0.0.1:{port}"
    with running(command, f"{url}/health", log, env):
        yield url


def shown_turns(page: Any) -> list[dict[str, Any]]:
    """Each turn box as the page shows it."""
    return list(
        page.eval_on_selector_all(
            "#turns .turn",
            """boxes => boxes.map(box => ({
                label: box.querySelector(".label").textContent,
                width: parseFloat(box.querySelector(".bar").style.width),
                memoryLabel: box.querySelector(".memory .label").textContent,
                memory: Array.from(box.querySelectorAll(".memory .mem > :not(del)"))
                    .map(n => n.textContent).join(" "),
                text: box.textContent,
            }))""",
        )
    )


def test_the_viewer_shows_each_turn_as_the_server_answers_it(server: str, tmp_path: Path) -> None:
    agent = httpx.get(f"{server}/health").json()["agent"]
    plain = httpx.post(f"{server}/v1/answer", json={"question": QUESTION}, timeout=300).json()
    expected = plain["trajectory"]["turns"]
    assert plain["searches"] >= 1  # a turn with hits and a turn after it
    requests: list[str] = []
    with browser() as chromium:
        page = chromium.new_page(viewport={"width": 1000, "height": 300})
        page.on("request", lambda r: requests.append(r.url))
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        if agent == "memsearcher":  # typed into the box
            page.goto(f"{server}/")
            page.fill("#question", QUESTION)
            page.click("#ask button")
        else:  # a link that asks at once
            page.goto(f"{server}/?q={quote(QUESTION)}")
            assert page.input_value("#question") == QUESTION
        page.wait_for_function("document.getElementById('agent').textContent !== ''")
        assert page.text_content("#agent") == f"agent {agent} \u00b7 model memsearcher"
        page.wait_for_selector("#answer .label", timeout=300_000)
        answer = page.text_content("#answer") or ""
        turns = shown_turns(page)
        screenshot = tmp_path / f"viewer-{agent}.png"
        page.screenshot(path=str(screenshot), full_page=True)
        if folder := os.environ.get("MEMSEARCHER_SCREENSHOTS"):  # for the README's picture
            page.screenshot(path=str(Path(folder) / screenshot.name), full_page=True)
    assert errors == []
    assert requests and all(url.startswith(f"{server}/") for url in requests)
    assert f"answer: {plain['answer']}" in answer
    assert f"{plain['turns']} turns \u00b7 {plain['searches']} searches" in answer
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    assert len(turns) == len(expected)
    for shown, turn in zip(turns, expected, strict=True):
        label = re.search(r"context (\d+) tokens", shown["label"])
        assert label and int(label.group(1)) == turn["prompt_tokens"] > 0
        assert shown["width"] > 0
        if turn["query"]:
            assert turn["query"] in shown["text"]
            assert all(hit["title"] in shown["text"] for hit in turn["hits"])
    widths = [shown["width"] for shown in turns]
    assert max(widths) == 100.0
    if agent == "memsearcher":  # each turn shows the memory it ended with, word for word
        for shown, turn in zip(turns, expected, strict=True):
            assert shown["memoryLabel"].startswith("memory")
            assert shown["memory"].split() == turn["memory"].split()
    else:  # ReAct keeps no memory, and its context grows with each turn
        assert all(s["memoryLabel"].startswith("no memory") for s in turns)
        assert widths == sorted(widths) and widths[0] < widths[-1]


def test_the_viewer_runs_only_its_own_script(server: str) -> None:
    """The page's Content-Security-Policy lets run its own inline script and style (by hash)
    and talk to its own server, nothing else. The negative control: the same page with one
    character added to its script, under the same header, is refused by the browser."""
    response = httpx.get(f"{server}/")
    assert response.headers["content-type"].startswith("text/html")
    policy = response.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert "unsafe-inline" not in policy

    def tampered(route: Any) -> None:
        original = route.fetch()
        body = original.text().replace('"use strict";', '"use strict";;', 1)
        route.fulfill(response=original, body=body)

    with browser() as chromium:
        for tamper in (False, True):
            page = chromium.new_page()
            console: list[str] = []
            page.on("console", lambda m, lines=console: lines.append(m.text))
            if tamper:
                page.route(f"{server}/", tampered)
            page.goto(f"{server}/")
            page.wait_for_load_state("networkidle")
            ran = page.text_content("#agent") != ""
            assert ran is not tamper, console
            if tamper:
                assert any("Content Security Policy" in line for line in console), console
