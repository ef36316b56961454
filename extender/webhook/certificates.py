"""Serving a renewed certificate without a restart.

cert-manager renews the webhook's certificate before it expires and the kubelet swaps the Secret's files in the
pod; a server that loaded them once would serve the old certificate until it expired, and then every call would
fail, which the API server (failurePolicy Ignore) turns into pods silently left to the default scheduler. So the
files are checked every few seconds and, when they change, loaded into the live SSL context: new connections get the
new certificate, open ones keep theirs.

The check runs as a task on the server's event loop rather than a Worker thread: the loop is where handshakes use
the context, so a reload never races one.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import Callable
from pathlib import Path

import structlog

from extender.webhook.metrics import WebhookMetrics

log = structlog.get_logger(__name__)

Stamp = tuple[tuple[int, int, int], ...]


def stamp(paths: tuple[Path, ...]) -> Stamp:
    """What changes when a file is rewritten or its Secret symlink is swapped (links followed)."""
    out = []
    for path in paths:
        st = os.stat(path)
        out.append((st.st_mtime_ns, st.st_size, st.st_ino))
    return tuple(out)


async def keep_fresh(context: ssl.SSLContext, cert: Path, key: Path, interval_s: float, metrics: WebhookMetrics,
                     clock_sleep: Callable[[float], object] = asyncio.sleep) -> None:
    """Reload `cert` and `key` into `context` whenever they change; runs until cancelled. A pair that does not load
    (a half-written update, a key that does not match) is logged and the old certificate kept; the next change
    tries again."""
    paths = (cert, key)
    try:
        last = stamp(paths)
    except OSError:
        last = ()
    while True:
        await clock_sleep(interval_s)  # type: ignore[misc]
        try:
            now = stamp(paths)
        except OSError as e:
            log.warning("extender.certificate.unreadable", error=str(e))
            continue
        if now == last:
            continue
        last = now
        try:
            context.load_cert_chain(cert, key)
        except (ssl.SSLError, OSError) as e:
            metrics.certificate_reloads.labels("failed").inc()
            log.warning("extender.certificate.reload_failed", cert=str(cert), error=str(e),
                        hint="the previous certificate is still served")
            continue
        metrics.certificate_reloads.labels("done").inc()
        log.info("extender.certificate.reloaded", cert=str(cert))
