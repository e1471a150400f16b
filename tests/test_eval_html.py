"""``eval report --html``: one self-contained page that holds every question of every run.

Runs are made as in test_eval.py: a scripted LLM on the real tokenizer, with the real agents,
eval loop and a real BM25 index over a small corpus. One passage spells ``</script><b>x`` to
try to break out of the page's embedded JSON.
"""

from __future__ import annotations

import json
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from _browser import browser

from memsearcher.agent import AgentConfig
from memsearcher.agent.replay import search_then_answer
from memsearcher.cli import main
from memsearcher.eval.html import embed_json
from memsearcher.eval.report import format_table, load_rows
from memsearcher.eval.run import EvalConfig, run_eval
from memsearcher.llm.hf import HFModel
from memsearcher.llm.scripted import ScriptedLLM
from memsearcher.retrieval.bm25 import build_bm25
from memsearcher.retrieval.corpus import Passage, write_corpus
from memsearcher.types import QAExample

AGENTS = ("memsearcher", "react", "mem1")
BREAKOUT = "</script><b>x</b><!-- & <script>alert(1)</script>"


class Page(HTMLParser):
    """Collects what the tests look at: tags, attributes with URLs, the JSON, table cells."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.urls: list[str] = []
        self.scripts: list[tuple[dict[str, str | None], str]] = []
        self.cells: list[list[str]] = []
        self._script: dict[str, str | None] | None = None
        self._in_cell = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        self.urls += [v or "" for k, v in attrs if k in ("src", "href")]
        if tag == "script":
            self._script = dict(attrs)
            self.scripts.append((self._script, ""))
        if tag == "tr":
            self.cells.append([])
        if tag in ("td", "th"):
            self._in_cell = True
            self.cells[-1].append("")

    def handle_endtag(self, tag: str) -> None:
        if tag == "script":
            self._script = None
        if tag in ("td", "th"):
            self._in_cell = False

    def handle_data(self, data: str) -> None:
        if self._script is not None:
            attrs, text = self.scripts[-1]
            self.scripts[-1] = (attrs, text + data)
        if self._in_cell:
            self.cells[-1][-1] += data


def parse(text: str) -> Page:
    page = Page()
    page.feed(text)
    page.close()
    return page


def embedded(page: Page) -> dict[str, Any]:
    (text,) = [t for attrs, t in page.scripts if attrs.get("type") == "application/json"]
    data: dict[str, Any] = json.loads(text)
    return data


def make_runs(tmp_path: Path, llm: HFModel) -> tuple[list[str], list[QAExample]]:
    passages = [Passage("0", "Zorblax", f"Zorblax is a city. {BREAKOUT} zorblax")]
    passages += [
        Passage(str(i), f"Filler {i}", f"filler text about place {i}") for i in range(1, 6)
    ]
    write_corpus(tmp_path / "c.jsonl", passages)
    index = build_bm25(tmp_path / "c.jsonl", tmp_path / "idx")
    examples = [QAExample("z", "Where is zorblax?", ("nowhere",))]
    examples += [QAExample(f"q{i}", f"What is place {i}?", ("Paris",)) for i in range(1, 4)]
    runs = []
    for agent, searches in (("memsearcher", 2), ("react", 1), ("mem1", 2)):
        scripted = ScriptedLLM(llm.tokenizer, search_then_answer(searches, answer="Paris"))
        config = EvalConfig(agent, AgentConfig(max_turns=4))
        out = tmp_path / agent
        run_eval({"nq": examples[:3], "hotpotqa": examples[1:]}, scripted, index, config, out,
                 progress=False)  # fmt: skip
        runs.append(str(out))
    return runs, examples


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory, llm: HFModel) -> dict[str, Any]:
    tmp_path = tmp_path_factory.mktemp("html")
    runs, examples = make_runs(tmp_path, llm)
    out = tmp_path / "report.html"
    code = main(["eval", "report", *runs, "--no-plots", "--html", str(out)])
    assert code == 0
    return {"runs": runs, "examples": examples, "text": out.read_text(encoding="utf-8")}


def test_the_page_is_one_file_with_every_question_of_every_run(report: dict[str, Any]) -> None:
    page = parse(report["text"])
    assert page.tags.count("html") == 1 and page.tags.count("script") == 2
    # nothing to fetch: no src or href at all (plots are data: URIs, off here)
    assert page.urls == []
    data = embedded(page)
    assert [r["label"] for r in data["runs"]] == list(AGENTS)
    assert [r["agent"] for r in data["runs"]] == list(AGENTS)
    expected = {("nq", e.id) for e in report["examples"][:3]}
    expected |= {("hotpotqa", e.id) for e in report["examples"][1:]}
    assert {(q["dataset"], q["id"]) for q in data["questions"]} == expected
    assert all(all(record is not None for record in q["runs"]) for q in data["questions"])
    # a sampled question: each run's trajectory, turn by turn
    (question,) = [q for q in data["questions"] if q["dataset"] == "nq" and q["id"] == "q1"]
    memsearcher, react, _ = question["runs"]
    assert question["question"] == "What is place 1?" and question["gold"] == ["Paris"]
    assert [t["query"] is not None for t in memsearcher["turns"]] == [True, True, False]
    assert [t["query"] is not None for t in react["turns"]] == [True, False]
    assert memsearcher["turns"][-1]["answer"] == "Paris" and memsearcher["em"] == 1.0
    assert all(t["memory"] for t in memsearcher["turns"][:2])  # rewritten after each search
    assert all(t["memory"] is None for t in react["turns"])
    assert all(t["prompt_tokens"] > 0 for t in memsearcher["turns"] + react["turns"])
    assert react["turns"][1]["prompt_tokens"] > react["turns"][0]["prompt_tokens"]
    assert all(t["hits"] and t["hits"][0]["title"] for t in react["turns"][:1])


def test_a_passage_that_closes_the_script_tag_stays_text(report: dict[str, Any]) -> None:
    page = parse(report["text"])
    assert "b" not in page.tags  # the passage's <b> never became markup
    data = embedded(page)
    (question,) = [q for q in data["questions"] if q["id"] == "z"]
    texts = [h["text"] for r in question["runs"] for t in r["turns"] for h in t["hits"]]
    assert any(BREAKOUT in text for text in texts)


def test_without_the_escaping_the_passage_breaks_the_page(report: dict[str, Any]) -> None:
    """The negative control: the same page with the JSON embedded raw is broken by it."""
    data = embedded(parse(report["text"]))
    raw = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    broken = report["text"].replace(embed_json(data), raw)
    assert broken != report["text"]
    page = parse(broken)
    assert "b" in page.tags
    with pytest.raises(json.JSONDecodeError):
        embedded(page)


def test_the_metrics_table_has_the_numbers_of_the_text_report(report: dict[str, Any]) -> None:
    page = parse(report["text"])
    lines = format_table(load_rows(report["runs"])).splitlines()
    text_cells = [lines[0].split()] + [line.split() for line in lines[2:]]
    html_cells = [[c for c in row if c] for row in page.cells]
    # the text table splits titles such as "tok p50" in two; compare the data rows whole
    assert len(html_cells) == len(text_cells) == 1 + 3 * 3  # 3 runs x (2 datasets + avg)
    assert html_cells[1:] == text_cells[1:]
    assert html_cells[0][:6] == ["run", "dataset", "agent", "n", "N", "EM"]


@pytest.mark.slow
def test_the_page_embeds_the_plots_as_data(
    tmp_path: Path, llm: HFModel, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    runs, _ = make_runs(tmp_path, llm)
    out = tmp_path / "report.html"
    assert main(["eval", "report", *runs, "--plots", str(tmp_path / "p"), "--html", str(out)]) == 0
    page = parse(out.read_text(encoding="utf-8"))
    assert page.urls and all(url.startswith("data:image/png;base64,") for url in page.urls)
    assert len(page.urls) == 2  # tokens per turn, one plot a dataset
    assert "html:" in capsys.readouterr().err


@pytest.mark.slow
def test_the_page_opened_in_a_browser_shows_every_run_turn_by_turn(
    report: dict[str, Any], tmp_path: Path
) -> None:
    """The real page in a real headless Chromium, opened from disk: each question, clicked,
    shows one column a run and one box a turn, as the embedded data holds them; the page asks
    for nothing but itself (anything else would be refused and recorded)."""

    path = tmp_path / "report.html"
    path.write_text(report["text"], encoding="utf-8")
    data = embedded(parse(report["text"]))
    fetched: list[str] = []

    def only_the_file(route: Any) -> None:
        fetched.append(route.request.url)
        if route.request.url == path.as_uri():
            route.continue_()
        else:
            route.abort()

    with browser() as chromium:
        page = chromium.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.route("**/*", only_the_file)
        page.goto(path.as_uri())
        rows = page.query_selector_all("#questions .q")
        assert len(rows) == len(data["questions"])
        for row, question in zip(rows, data["questions"], strict=True):
            row.click()
            assert page.text_content("#detail h3") == question["question"]
            columns = page.eval_on_selector_all(
                "#detail .run",
                "cols => cols.map(c => ({run: c.dataset.run, text: c.textContent,"
                " turns: c.querySelectorAll('.turn').length,"
                " memories: c.querySelectorAll('.turn .memory').length,"
                " bars: Array.from(c.querySelectorAll('.bar'), b => parseFloat(b.style.width)),"
                " added: Array.from(c.querySelectorAll('ins'), n => n.textContent)}))",
            )
            assert [c["run"] for c in columns] == list(AGENTS)
            for column, record in zip(columns, question["runs"], strict=True):
                assert column["turns"] == column["memories"] == len(record["turns"])
                assert f"answer: {record['prediction']}" in column["text"]
                assert len(column["bars"]) == column["turns"] and min(column["bars"]) > 0
            assert max(b for c in columns for b in c["bars"]) == 100.0
            memory = question["runs"][0]["turns"][0]["memory"].split()
            assert columns[0]["added"][: len(memory)] == memory  # all new at first
            assert columns[1]["added"] == []  # ReAct keeps no memory
            # MEM1 keeps its internal state (its <think>) as its memory
            state = question["runs"][2]["turns"][0]["thought"].split()
            assert "internal state" in columns[2]["text"]
            assert columns[2]["added"][: len(state)] == state
    assert errors == [] and set(fetched) == {path.as_uri()}
