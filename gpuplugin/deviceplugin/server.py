"""One gRPC server serving the DevicePlugin service on a unix socket, and the socket's identity.

The identity (device, inode, ctime) tells "our socket is still there" from "someone deleted it" (the kubelet does
on restart) even when the name exists again, which the lifecycle uses to decide when to serve anew.
"""

from __future__ import annotations

import contextlib
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import structlog

from gpuplugin.deviceplugin.errors import ServeError
from gpuplugin.deviceplugin.resource import ResourceManager
from gpuplugin.deviceplugin.servicer import DevicePluginServicer
from gpuplugin.proto import deviceplugin_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

# Every ListAndWatch stream holds a worker for its whole life; the kubelet opens one, a restarting kubelet may
# briefly hold a second, and the unary calls need the rest.
DEFAULT_WORKERS = 8

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
    """Serves once: start() then stop(). The lifecycle creates a new one for every restart."""

    def __init__(self, manager: ResourceManager, socket_path: Path, max_workers: int = DEFAULT_WORKERS) -> None:
        if max_workers < 4:
            raise ValueError(f"max_workers must be at least 4 (each ListAndWatch holds one), got {max_workers}")
        self.socket_path = Path(socket_path)
        self.servicer = DevicePluginServicer(manager)
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="deviceplugin")
        self._server = grpc.server(self._pool)
        pb_grpc.add_DevicePluginServicer_to_server(self.servicer, self._server)
        self.identity: FileIdentity | None = None

    def start(self) -> None:
        remove_stale(self.socket_path)
        try:
            self._server.add_insecure_port(f"unix:{self.socket_path}")
        except RuntimeError as e:
            self._pool.shutdown(wait=False)
            raise ServeError(f"cannot listen on {self.socket_path}: {e}") from e
        self._server.start()
        self.identity = file_identity(self.socket_path)
        if self.identity is None:
            self._server.stop(0)
            self._pool.shutdown(wait=False)
            raise ServeError(f"server started but no socket appeared at {self.socket_path}")
        log.info("plugin.server.serving", socket=str(self.socket_path))

    def intact(self) -> bool:
        """True while the socket we bound is still the file at our path."""
        return self.identity is not None and file_identity(self.socket_path) == self.identity

    def stop(self, grace: float = 1.0) -> None:
        """End the streams, stop serving, and remove our socket (only if it is still ours)."""
        self.servicer.close()
        self._server.stop(grace).wait()
        self._pool.shutdown(wait=False)
        if self.intact():
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        self.identity = None
        log.info("plugin.server.stopped_serving", socket=str(self.socket_path))
