"""HTTP clients for tests that call a server from many threads at once: one httpx.Client per thread.

A single httpx.Client shared by 32 threads now and then failed a read with EBADF (a pooled connection closed under
another thread's read), which made the concurrency tests flaky for a reason that was the test's, not the server's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx


@contextmanager
def thread_clients(base_url: str | httpx.URL, **options: Any) -> Iterator[Callable[[], httpx.Client]]:
    """Yields a function giving the calling thread its own client for `base_url`; every one is closed at exit."""
    local = threading.local()
    made: list[httpx.Client] = []
    lock = threading.Lock()

    def client() -> httpx.Client:
        c = getattr(local, "client", None)
        if c is None:
            c = local.client = httpx.Client(base_url=base_url, **{"timeout": 30, **options})
            with lock:
                made.append(c)
        return c

    try:
        yield client
    finally:
        for c in made:
            c.close()
