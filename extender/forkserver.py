"""Where the bind worker processes (extender.bindposts) fork from: a forkserver that imported the kubernetes
client once. A fresh interpreter takes seconds to import it on a busy node, and forking the serving process itself
would copy its threads' locks mid-use. Light on purpose (the standard library only): `gpu-extender serve` starts the
forkserver before its own imports, so the two processes import side by side (about 1.8 s of the 6.4 s to ready on
a 2-core machine)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import threading

PRELOAD = ["extender.bindposts", "gputopo.kube", "kubernetes.client.api.core_v1_api"]

_CONTEXT: multiprocessing.context.BaseContext | None = None
_LOCK = threading.Lock()


def worker_context() -> multiprocessing.context.BaseContext:
    """The context bind workers are started from (the forkserver starts with the first, unless `start_early`)."""
    global _CONTEXT
    with _LOCK:
        if _CONTEXT is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD)
            _CONTEXT = ctx
        return _CONTEXT


def start_early() -> None:
    """Start the forkserver now; it imports PRELOAD in its own process while this one goes on."""
    worker_context()
    multiprocessing.forkserver.ensure_running()
