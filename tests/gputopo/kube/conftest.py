"""The watcher tests' event recorder, and the thread-leak check for every test here (`fake` and `api` come
from tests/conftest.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest


class Events:
    """Thread-safe recorder of watcher callbacks with an event-driven wait (timeouts only bound failures)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, dict]] = []
        self._cond = threading.Condition()

    def __call__(self, event_type: str, obj: dict) -> None:
        with self._cond:
            self.items.append((event_type, obj))
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[list[tuple[str, dict]]], bool], timeout: float = 10.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.items), timeout)

    def names(self, event_type: str) -> list[str]:
        with self._cond:
            return [o["metadata"].get("name", "") for t, o in self.items if t == event_type]

    def snapshots(self) -> list[dict]:
        with self._cond:
            return [o for t, o in self.items if t == "SYNC"]

    def has(self, event_type: str, name: str) -> Callable[[list[tuple[str, dict]]], bool]:
        return lambda items: any(t == event_type and o["metadata"].get("name") == name for t, o in items)


@pytest.fixture(autouse=True)
def _no_leaked_threads(no_leaked_threads: None) -> None:
    """Every server, watcher and worker thread a test here starts must be gone when it ends (tests/conftest.py)."""
