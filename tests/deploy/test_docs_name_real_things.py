"""The hand-written pages name only what exists: a chart value path is one of values.yaml, a command line of ours
uses that command's own options, and the README's table of main settings gives each value's real default. The
full lists are generated (docs/generated/, scripts/gen_reference.py); these pages quote parts of them in prose, and
a renamed value or flag must fail here rather than mislead a reader."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from scripts import gen_reference
from tests.helpers.paths import REPO

VALUES = yaml.safe_load((REPO / "deploy" / "helm" / "gpu-topology" / "values.yaml").read_text())
SCHEMA_ONLY = {"enabled"}  # read by a parent chart's condition: (values.schema.json)
PAGES = [REPO / "README.md", REPO / "deploy" / "README.md",
         *sorted(p for p in (REPO / "docs").glob("*.md"))]
CODE = re.compile(r"`([^`\n]+)`")
DOTTED = re.compile(r"(?<![\w./-])([a-z][A-Za-z0-9]*(?:\.(?:[A-Za-z0-9]+|\*))+)")
LOG_EVENT = re.compile(r"^(plugin|dra|extender|kube|discovery|worker|sim)\.[a-z0-9_]+\.[a-z0-9_]+$")
COMMAND = re.compile(r"^(gpuplugin|gpu-extender) ([a-z][a-z-]*)(.*)$")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")


def _value_exists(path: str) -> bool:
    node: Any = VALUES
    for part in path.split("."):
        if part == "*":
            return True
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _is_module(path: str) -> bool:
    """`extender.jobs.spread`, `dra.py`: a module or file the page points at, not a chart value."""
    parts = path.split(".")
    return any((REPO / Path(*parts[:i])).with_suffix(".py").is_file() or (REPO / Path(*parts[:i])).is_dir()
               for i in range(1, len(parts) + 1)) or (REPO / path).exists() or path.endswith((".py", ".yaml"))


def _options() -> dict[str, set[str]]:
    """'gpuplugin run' -> every option spelling it takes."""
    out: dict[str, set[str]] = {}
    for name, command, _ in gen_reference.cli_commands():
        opts = out.setdefault(name, {"--help"})
        for param in command.params:
            for spelling in (*getattr(param, "opts", ()), *getattr(param, "secondary_opts", ())):
                opts.add(spelling.split("=")[0])
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_chart_value_a_page_names_is_in_values_yaml(page: Path) -> None:
    wrong = []
    for code in CODE.findall(page.read_text()):
        for path in DOTTED.findall(code):
            top = path.split(".")[0]
            if top not in VALUES or top in SCHEMA_ONLY:
                continue
            if _value_exists(path) or LOG_EVENT.match(path) or _is_module(path):
                continue
            wrong.append(path)
    assert not wrong, f"{page.name} names chart values values.yaml does not have: {sorted(set(wrong))}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_line_of_ours_a_page_shows_uses_real_options(page: Path) -> None:
    options = _options()
    wrong = []
    for code in CODE.findall(page.read_text()):
        match = COMMAND.match(code.strip())
        if match is None:
            continue
        name = f"{match[1]} {match[2]}"
        if name not in options:
            if match[2] != "demo":  # the simulator's, plugged into gpuplugin from outside the product
                wrong.append(f"{name} (no such command)")
            continue
        wrong += [f"{name} {flag}" for flag in FLAG.findall(match[3]) if flag not in options[name]]
    assert not wrong, f"{page.name} shows options our commands do not take: {wrong}"


def _readme_settings() -> list[tuple[str, str]]:
    text = (REPO / "README.md").read_text()
    section = text.split("## Main settings", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)` \| `([^`]+)`", section, flags=re.M)


def test_the_readme_gives_each_main_setting_its_real_default() -> None:
    rows = _readme_settings()
    assert len(rows) >= 5
    wrong = []
    for path, default in rows:
        if path.endswith(".*"):
            continue
        node: Any = VALUES
        for part in path.split("."):
            node = node[part]
        shown = yaml.safe_load(default)
        if node != shown:
            wrong.append(f"{path}: README says {default}, values.yaml has {node!r}")
    assert not wrong, wrong
