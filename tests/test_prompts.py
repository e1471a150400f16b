from __future__ import annotations

import json
from pathlib import Path

import pytest

from memsearcher.agent.prompts import (
    TOOL_NAME,
    Templates,
    format_tools,
    load_templates,
    read_templates,
)
from memsearcher.agent.shop_agents import ShopTemplates
from memsearcher.errors import MemSearcherError


def test_default_templates_render() -> None:
    templates = Templates()
    system = templates.memsearcher_system.format(tools=format_tools(5))
    schema = json.loads(system.split("<tools>\n")[1].split("\n</tools>")[0])
    assert schema["function"]["name"] == TOOL_NAME
    assert schema["function"]["parameters"]["properties"]["top_n"]["default"] == 5
    assert "<memory>" in system and "\\boxed{answer}" in system
    user = templates.memsearcher_user.format(question="Q?", memory="")
    assert user == "<question> Q? </question>\n\n<memory>  </memory>"


def test_templates_override_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text('react_user: "Question: {question}"\n')
    templates = load_templates(path)
    assert templates.react_user == "Question: {question}"
    assert templates.memsearcher_user == Templates().memsearcher_user


def test_templates_override_from_json(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(
        json.dumps({"memsearcher_tool_response": "<tool_response>{passages}</tool_response>"})
    )
    assert load_templates(path).memsearcher_tool_response.startswith("<tool_response>")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nope: 1\n", "unknown templates"),
        ('react_user: "{questio}"\n', "unknown fields"),
        ('react_user: "{question"\n', "react_user"),
        ("- a list\n", "mapping"),
        ("react_user: [1\n", "not valid YAML"),
    ],
)
def test_bad_template_files(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(text)
    with pytest.raises(MemSearcherError, match=message):
        load_templates(path)


def test_missing_template_file(tmp_path: Path) -> None:
    with pytest.raises(MemSearcherError, match="cannot read"):
        load_templates(tmp_path / "absent.yaml")


def test_shop_templates_override_from_a_file_and_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "shop.yaml"
    path.write_text('react_page: "Page: {page}"\n')
    templates = read_templates(path, ShopTemplates)
    assert templates.react_page == "Page: {page}"
    assert templates.memsearcher_user == ShopTemplates().memsearcher_user
    path.write_text('memsearcher_tool_response: "{passages}"\n')  # a search template
    with pytest.raises(MemSearcherError, match="unknown templates.*known: .*react_page"):
        read_templates(path, ShopTemplates)
    path.write_text('react_page: "{passages}"\n')
    with pytest.raises(MemSearcherError, match="react_page.*unknown fields"):
        read_templates(path, ShopTemplates)
