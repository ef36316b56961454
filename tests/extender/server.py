"""Run an ASGI app under uvicorn on 127.0.0.1 in a background thread, on a free port."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from tests.helpers.polling import eventually


@contextmanager
def serve(app: Any, **config: Any) -> Iterator[str]:
    """Yield the base URL of a live uvicorn serving `app`; shut it down (lifespan included) on exit."""
    cfg = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False, lifespan="on",
                         **config)
    server = uvicorn.Server(cfg)
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    thread = threading.Thread(target=server.run, name="uvicorn-test", daemon=True)
    thread.start()
    eventually(lambda: server.started or not thread.is_alive(), 20, interval=0.01)
    if not server.started:
        raise RuntimeError("uvicorn did not start")
    port = server.servers[0].sockets[0].getsockname()[1]
    scheme = "https" if config.get("ssl_certfile") else "http"
    try:
        yield f"{scheme}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(20)
