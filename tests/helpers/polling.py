"""Waiting for a fact no one notifies about (a file appears, another process answers, a thread ends). Where the
code under test offers an event (a condition, `wait_for`, `wait_synced`), wait on that instead. A timeout only
bounds a failure: it is never a performance figure (those come from bench/)."""

from __future__ import annotations

import time
from collections.abc import Callable


def eventually(predicate: Callable[[], object], timeout: float = 15.0, interval: float = 0.05) -> bool:
    """Poll `predicate` until it is truthy (True) or `timeout` seconds pass (False, after one last look); the
    caller asserts the result, with its own message."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return bool(predicate())
        time.sleep(interval)
    return True
