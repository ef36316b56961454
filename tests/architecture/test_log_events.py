"""One log event naming scheme across the product: `component.noun.verb` (lowercase, three dotted parts), where
the component is the binary or shared part that speaks: plugin, dra (the DRA driver), extender, kube, discovery,
worker, sim."""

from __future__ import annotations

import ast
import re

from tests.helpers.paths import REPO

PACKAGES = ("gputopo", "gpuplugin", "extender", "sim")
EVENT = re.compile(r"^(plugin|dra|extender|kube|discovery|worker|sim)\.[a-z0-9_]+\.[a-z0-9_]+$")
LEVELS = frozenset({"debug", "info", "warning", "warn", "error", "exception", "critical", "msg"})
LOGGERS = re.compile(r"^(log|_log|logger|self\._log|self\.log|self\._logger)$")


def _is_log_method(func: ast.expr) -> bool:
    """`log.info`, `self._log.warning`, or `(log.warning if x else log.debug)`."""
    if isinstance(func, ast.IfExp):
        return _is_log_method(func.body) and _is_log_method(func.orelse)
    return isinstance(func, ast.Attribute) and func.attr in LEVELS and bool(LOGGERS.match(ast.unparse(func.value)))


def log_events() -> list[tuple[str, int, str]]:
    """(file, line, event) of every structlog call in the product's packages; an event that is not a literal string
    (an f-string, a variable) is reported as its source text, so it fails the scheme."""
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if "proto" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (isinstance(node, ast.Call) and _is_log_method(node.func) and node.args):
                    continue
                first = node.args[0]
                literal = isinstance(first, ast.Constant) and isinstance(first.value, str)
                found.append((str(path.relative_to(REPO)), node.lineno,
                              first.value if literal else f"<not a literal: {ast.unparse(first)}>"))
    return found


def test_every_log_event_follows_the_scheme() -> None:
    events = log_events()
    assert len(events) > 50  # the walk finds the project's log calls
    bad = [f"{f}:{line}: {event!r}" for f, line, event in events if not EVENT.match(event)]
    assert not bad, "\n".join(bad)
