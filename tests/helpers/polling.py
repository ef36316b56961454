"""Waiting for a fact no one notifies about (a file appears, another process answers, a thread ends). Where the
code under test offers an event (a condition, `wait_for`, `wait_synced`), wait on that instead. A timeout only
bounds a failure: it is never a performance figure (those come from bench/)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable

FACTOR_ENV = "GPUTOPO_TEST_TIME_FACTOR"
MAX_FACTOR = 8.0


def machine_factor() -> float:
    """How many times an idle machine's time a wait may need now: the runnable work per core (1-minute load average
    over the cores), at least 1 and at most 8; `GPUTOPO_TEST_TIME_FACTOR` sets it instead. Read at each wait, so a
    deadline set while CPU burners run is longer than one set on a quiet machine."""
    fixed = os.environ.get(FACTOR_ENV)
    if fixed:
        return min(MAX_FACTOR, max(1.0, float(fixed)))
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return 1.0
    return min(MAX_FACTOR, max(1.0, load / (os.cpu_count() or 1)))


def scaled(seconds: float) -> float:
    """A deadline of `seconds` on an idle machine, stretched by `machine_factor()`."""
    return seconds * machine_factor()


def eventually(predicate: Callable[[], object], timeout: float = 15.0, interval: float = 0.05) -> bool:
    """Poll `predicate` until it is truthy (True) or `timeout` seconds pass (False, after one last look); the
    caller asserts the result, with its own message. `timeout` is the idle machine's: it is stretched by the load
    (`scaled`)."""
    deadline = time.monotonic() + scaled(timeout)
    while not predicate():
        if time.monotonic() >= deadline:
            return bool(predicate())
        time.sleep(interval)
    return True
