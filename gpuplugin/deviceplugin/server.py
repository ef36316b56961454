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
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

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

FileIdentity = tuple[int, int, int]
T = TypeVar("T")


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
    """Serves once: start() then stop(). The lifecycle creates a new one for every restart."""

    def __init__(self, manager: ResourceManager, socket_path: Path, *, max_streams: int = DEFAULT_MAX_STREAMS,
                 max_unary: int = DEFAULT_MAX_UNARY) -> None:
        if max_unary < 1:
            raise ValueError(f"max_unary must be at least 1, got {max_unary}")
        self.socket_path = Path(socket_path)
        self.servicer = DevicePluginServicer(manager, max_streams)
        self.max_calls = max_streams + max_unary
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: grpc.aio.Server | None = None
        self.identity: FileIdentity | None = None

    def _run(self, coro: Coroutine[Any, Any, T], timeout: float = START_TIMEOUT_S) -> T:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _serve(self) -> grpc.aio.Server:
        server = grpc.aio.server(maximum_concurrent_rpcs=self.max_calls)
        pb_grpc.add_DevicePluginServicer_to_server(self.servicer, server)
        try:
            server.add_insecure_port(f"unix:{self.socket_path}")
        except RuntimeError as e:
            await server.stop(0)
            raise ServeError(f"cannot listen on {self.socket_path}: {e}") from e
        await server.start()
        return server

    def start(self) -> None:
        remove_stale(self.socket_path)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="deviceplugin-grpc", daemon=True)
        self._thread.start()
        try:
            self._server = self._run(self._serve())
        except BaseException:
            self._shutdown_loop()
            raise
        self.identity = file_identity(self.socket_path)
        if self.identity is None:
            self.stop(0)
            raise ServeError(f"server started but no socket appeared at {self.socket_path}")
        log.info("plugin.server.serving", socket=str(self.socket_path), max_streams=self.servicer.max_streams)

    def intact(self) -> bool:
        """True while the socket we bound is still the file at our path."""
        return self.identity is not None and file_identity(self.socket_path) == self.identity

    def _shutdown_loop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(START_TIMEOUT_S)
        if loop is not None and not loop.is_running():
            loop.close()

    def stop(self, grace: float = 1.0) -> None:
        """End the streams, stop serving, and remove our socket (only if it is still ours)."""
        self.servicer.close()
        server, self._server = self._server, None
        if server is not None and self._loop is not None:
            with contextlib.suppress(TimeoutError):
                self._run(server.stop(grace), timeout=grace + START_TIMEOUT_S)
        self._shutdown_loop()
        if self.intact():
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        self.identity = None
        log.info("plugin.server.stopped_serving", socket=str(self.socket_path))
