"""One gRPC server serving the DevicePlugin service on a unix socket, and the socket's identity.

The server is grpc.aio on an event loop of its own thread: ListAndWatch streams are coroutines, not threads, so no
number of open streams can starve GetDevicePluginOptions (the kubelet's dial-back inside Register),
GetPreferredAllocation or Allocate. Streams are bounded by the servicer (`max_streams`), and every call together
by `max_streams + max_unary` (gRPC answers RESOURCE_EXHAUSTED past it rather than queueing without end).

The identity (device, inode, ctime) tells "our socket is still there" from "someone deleted it" (the kubelet does
on restart) even when the name exists again, which the lifecycle uses to decide when to serve anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import grpc
import structlog

from gpuplugin.deviceplugin.errors import ServeError
from gpuplugin.deviceplugin.resource import ResourceManager
from gpuplugin.deviceplugin.servicer import DEFAULT_MAX_STREAMS, DevicePluginServicer
from gpuplugin.proto import deviceplugin_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

# Unary calls in progress at once, beyond the streams; more are answered RESOURCE_EXHAUSTED at once.
DEFAULT_MAX_UNARY = 64
START_TIMEOUT_S = 10.0
# How long the handlers of the calls a stop cut may take to finish before they are cancelled.
SETTLE_S = 2.0
_CANCEL_ROUNDS = 2  # a task may start another as it ends (gRPC's limiter does): cancel those too, then give up

FileIdentity = tuple[int, int, int]


def file_identity(path: Path) -> FileIdentity | None:
    """(device, inode, ctime ns) of a socket file, or None when there is no socket at `path`."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISSOCK(st.st_mode):
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


def remove_stale(path: Path) -> None:
    """Remove a leftover file at our socket path (a previous run that was killed leaves its socket behind)."""
    try:
        if path.is_dir() and not path.is_symlink():
            raise ServeError(f"{path} is a directory, not a socket path")
        path.unlink()
        log.info("plugin.socket.stale_removed", path=str(path))
    except FileNotFoundError:
        pass
    except OSError as e:
        raise ServeError(f"cannot remove stale socket {path}: {e.strerror or e}") from e


class PluginServer:
    """Serves once: start() then stop(). The lifecycle creates a new one for every restart.

    The event loop belongs to its thread from start to end: the thread serves until stop() hands it the grace, then
    stops the server, waits for every task the server started (the handlers of the calls it cut finish on their
    own), closes the async generators and only then closes the loop. A loop stopped with tasks pending leaves them
    to the garbage collector, which reports each as destroyed while pending, finalizes its ListAndWatch generator
    on a closed loop ("Event loop is closed") and loses the failed batch of a call cut mid-send (ExecuteBatchError)."""

    def __init__(self, manager: ResourceManager, socket_path: Path, *, max_streams: int = DEFAULT_MAX_STREAMS,
                 max_unary: int = DEFAULT_MAX_UNARY) -> None:
        if max_unary < 1:
            raise ValueError(f"max_unary must be at least 1, got {max_unary}")
        self.socket_path = Path(socket_path)
        self.servicer = DevicePluginServicer(manager, max_streams)
        self.max_calls = max_streams + max_unary
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop_grace: asyncio.Future[float] | None = None  # resolved (on the loop) by stop()
        self.identity: FileIdentity | None = None

    async def _open(self) -> grpc.aio.Server:
        server = grpc.aio.server(maximum_concurrent_rpcs=self.max_calls)
        pb_grpc.add_DevicePluginServicer_to_server(self.servicer, server)
        try:
            server.add_insecure_port(f"unix:{self.socket_path}")
        except RuntimeError as e:
            await server.stop(None)
            raise ServeError(f"cannot listen on {self.socket_path}: {e}") from e
        await server.start()
        return server

    async def _serve(self, started: Future[None], stop_grace: asyncio.Future[float]) -> None:
        try:
            server = await self._open()
        except BaseException as e:
            started.set_exception(e)
            return
        started.set_result(None)
        grace = await stop_grace
        await server.stop(grace)

    def _run_loop(self, loop: asyncio.AbstractEventLoop, started: Future[None],
                  stop_grace: asyncio.Future[float]) -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve(started, stop_grace))
            settle(loop)
        except BaseException as e:  # the loop's own failure: nothing else reports it
            if not started.done():
                started.set_exception(e)
            log.exception("plugin.server.loop_failed", socket=str(self.socket_path))
        finally:
            asyncio.set_event_loop(None)
            loop.close()

    def start(self) -> None:
        remove_stale(self.socket_path)
        loop = asyncio.new_event_loop()
        loop.set_exception_handler(loop_exception_reporter(self.socket_path))
        started: Future[None] = Future()
        self._stop_grace = loop.create_future()  # the loop is not running yet: safe from this thread
        self._loop = loop
        self._thread = threading.Thread(target=self._run_loop, args=(loop, started, self._stop_grace),
                                        name="deviceplugin-grpc", daemon=True)
        self._thread.start()
        try:
            started.result(START_TIMEOUT_S)
        except BaseException:
            self._end_loop(0.0)
            raise
        self.identity = file_identity(self.socket_path)
        if self.identity is None:
            self.stop(0)
            raise ServeError(f"server started but no socket appeared at {self.socket_path}")
        log.info("plugin.server.serving", socket=str(self.socket_path), max_streams=self.servicer.max_streams)

    def intact(self) -> bool:
        """True while the socket we bound is still the file at our path."""
        return self.identity is not None and file_identity(self.socket_path) == self.identity

    def _end_loop(self, grace: float) -> None:
        """Hand the loop's thread the grace and wait for it to stop the server and close the loop."""
        loop, thread, stop_grace = self._loop, self._thread, self._stop_grace
        self._loop = self._thread = self._stop_grace = None
        if loop is None or thread is None or stop_grace is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop already ended (it failed): nothing left to stop
            loop.call_soon_threadsafe(_resolve, stop_grace, grace)
        thread.join(grace + SETTLE_S + START_TIMEOUT_S)
        if thread.is_alive():
            log.warning("plugin.server.stop_slow", socket=str(self.socket_path),
                        waited_s=grace + SETTLE_S + START_TIMEOUT_S,
                        hint="the server's thread is left to finish on its own")

    def stop(self, grace: float = 1.0) -> None:
        """End the streams, stop serving, and remove our socket (only if it is still ours). `grace`: how long calls
        in flight may take to finish before they are cut (the streams end at once either way)."""
        self.servicer.close()
        self._end_loop(grace)
        if self.intact():
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        self.identity = None
        log.info("plugin.server.stopped_serving", socket=str(self.socket_path))


def _resolve(future: asyncio.Future[float], grace: float) -> None:
    if not future.done():
        future.set_result(grace)


def settle(loop: asyncio.AbstractEventLoop, timeout: float = SETTLE_S) -> None:
    """Run `loop` until every task on it has finished (those still running after `timeout` seconds are cancelled
    and awaited), then close its async generators and its default executor: what asyncio.run does at its end,
    except that tasks get a chance to end on their own first. A call the server cut finishes its handler in a few
    loop turns; cancelling it meanwhile would cut it a second time, mid-send. Every task's outcome is retrieved
    here, so none is reported later as "never retrieved"."""
    deadline = time.monotonic() + timeout
    cancelled = 0
    while tasks := asyncio.all_tasks(loop):
        left = deadline - time.monotonic()
        if left > 0:
            loop.run_until_complete(asyncio.wait(tasks, timeout=left))
        elif cancelled < _CANCEL_ROUNDS:
            cancelled += 1
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.wait(tasks, timeout=timeout))
        else:  # tasks that survive cancellation: closing the loop is still better than hanging the lifecycle
            log.warning("plugin.server.tasks_left", tasks=sorted(t.get_name() for t in tasks)[:10])
            break
        for task in tasks:
            if task.done() and not task.cancelled() and (error := task.exception()) is not None:
                # A call cut by the stop: its failure is the cut, already answered to its client.
                log.debug("plugin.server.call_cut", task=task.get_name(), error=repr(error))
    loop.run_until_complete(loop.shutdown_asyncgens())
    loop.run_until_complete(loop.shutdown_default_executor())


def loop_exception_reporter(socket: Path) -> Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]:
    """The loop's reports (a callback that raised, a task destroyed while pending: a bug, since every task is
    awaited) as one structured event naming the server's socket, with the exception as structured data, instead
    of asyncio's text."""

    def report(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        log.error("plugin.server.loop_error", socket=str(socket), message=context.get("message", ""),
                  **{k: repr(v) for k, v in context.items() if k not in ("message", "exception")},
                  exc_info=error if isinstance(error, BaseException) else None)

    return report
