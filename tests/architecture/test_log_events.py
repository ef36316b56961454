"""One log event naming scheme across the product: `component.noun.verb` (lowercase, three dotted parts), where
the component is the binary or shared part that speaks: plugin, dra (the DRA driver), extender, kube, discovery,
worker, sim."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gputopo", "gpuplugin", "extender", "sim")
EVENT = re.compile(r"^(plugin|dra|extender|kube|discovery|worker|sim)\.[a-z0-9_]+\.[a-z0-9_]+$")
LEVELS = frozenset({"debug", "info", "warning", "warn", "error", "exception", "critical", "msg"})
LOGGERS = re.compile(r"^(log|_log|logger|self\._log|self\.log|self\._logger)$")


def log_events() -> list[tuple[str, int, str]]:
    """(file, line, event) of every structlog call with a literal event name in the product's packages."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "proto" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                    continue
                if node.func.attr not in LEVELS or not LOGGERS.match(ast.unparse(node.func.value)):
                    continue
                if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                    found.append((str(path.relative_to(ROOT)), node.lineno, node.args[0].value))
    return found


def test_every_log_event_follows_the_scheme() -> None:
    events = log_events()
    assert len(events) > 50  # the walk finds the project's log calls
    bad = [f"{f}:{line}: {event!r}" for f, line, event in events if not EVENT.match(event)]
    assert not bad, "\n".join(bad)
