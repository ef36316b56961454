"""Helpers of the reliability tests: the real plugin in a context manager, a raw
ListAndWatch consumer that keeps every message, and the checks every fault scenario ends with (sockets, threads).

Everything runs over real unix sockets; the kubelet is `sim.kubelet.KubeletSimulator`.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from gpuplugin.deviceplugin.lifecycle import PluginRunner
from gpuplugin.deviceplugin.resource import ResourceManager
from gpuplugin.proto import deviceplugin_pb2 as pb
from gpuplugin.proto import deviceplugin_pb2_grpc as pb_grpc
from gpuplugin.proto import podresources_pb2_grpc
from tests.conftest import process_wide
from tests.fakes.kubelet_podresources import FakePodResources
from tests.helpers.polling import eventually

# Liveness bound for every wait (never a performance assertion): generous for a loaded 2-core machine.
WAIT = 15.0
SOCKET_NAME = "gpu-topology.sock"


@pytest.fixture
def threads() -> ThreadBaseline:
    """The threads alive before the test; `threads.assert_none_leaked()` once everything is stopped."""
    return ThreadBaseline()


class ThreadBaseline:
    def __init__(self) -> None:
        self._before = {t.ident for t in threading.enumerate()}

    def extra(self) -> list[str]:
        return sorted(t.name for t in threading.enumerate()
                      if t.ident not in self._before and t.is_alive() and not process_wide(t))

    def assert_none_leaked(self, timeout: float = WAIT) -> None:
        """Threads started since the baseline must all end (thread pools wind down asynchronously: wait)."""
        eventually(lambda: not self.extra(), timeout)
        assert self.extra() == [], f"threads left running: {self.extra()}"


def is_socket(path: Path) -> bool:
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except FileNotFoundError:
        return False


def sockets_in(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if is_socket(p))


def stale_socket(path: Path) -> None:
    """A socket file nobody listens on, as a killed process leaves behind."""
    import socket

    s = socket.socket(socket.AF_UNIX)
    try:
        s.bind(str(path))
    finally:
        s.close()


@contextmanager
def running_plugin(manager: ResourceManager, plugin_dir: Path, **kwargs: object) -> Iterator[PluginRunner]:
    """The real PluginRunner with quick retries and a quick safety poll; stopped (socket removed) on exit."""
    kwargs.setdefault("backoff_initial", 0.05)
    kwargs.setdefault("backoff_max", 0.5)
    kwargs.setdefault("poll_interval", 0.2)
    runner = PluginRunner(manager, plugin_dir, **kwargs).start()  # type: ignore[arg-type]
    try:
        yield runner
    finally:
        runner.stop()


def options_call(plugin_dir: Path, timeout: float = WAIT) -> pb.DevicePluginOptions:
    """A normal call on our socket: what a dialling kubelet does first."""
    with grpc.insecure_channel(f"unix:{plugin_dir / SOCKET_NAME}") as channel:
        return pb_grpc.DevicePluginStub(channel).GetDevicePluginOptions(pb.Empty(), timeout=timeout)


class RawStream:
    """A ListAndWatch stream on our socket read on its own thread; keeps every message, notes how the stream ended.

    The simulator keeps only the latest list; this keeps the sequence, to count messages and spot duplicates."""

    def __init__(self, plugin_dir: Path) -> None:
        self._channel = grpc.insecure_channel(f"unix:{plugin_dir / SOCKET_NAME}")
        self._call = pb_grpc.DevicePluginStub(self._channel).ListAndWatch(pb.Empty())
        self._cond = threading.Condition()
        self.messages: list[dict[str, str]] = []  # device id -> health, in arrival order
        self.ended = threading.Event()
        self.end_code: grpc.StatusCode | None = None
        self._thread = threading.Thread(target=self._read, name="raw-listandwatch", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for resp in self._call:
                with self._cond:
                    self.messages.append({d.ID: d.health for d in resp.devices})
                    self._cond.notify_all()
            self.end_code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            self.end_code = e.code()
        finally:
            self.ended.set()
            with self._cond:
                self._cond.notify_all()

    def wait_for(self, predicate: Callable[[list[dict[str, str]]], bool], timeout: float = WAIT) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.messages), timeout)

    def latest(self) -> dict[str, str]:
        with self._cond:
            return dict(self.messages[-1]) if self.messages else {}

    def count(self) -> int:
        with self._cond:
            return len(self.messages)

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(WAIT)
        self._channel.close()

    def __enter__(self) -> RawStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextmanager
def podresources_server(socket_path: Path) -> Iterator[FakePodResources]:
    """The kubelet's PodResources service (tests/fakes/kubelet_podresources.py's servicer) on `socket_path`, with a
    thread pool that is shut down on exit, so the thread check sees only what the product leaves behind."""
    service = FakePodResources()
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="podresources-fake")
    server = grpc.server(pool)
    podresources_pb2_grpc.add_PodResourcesListerServicer_to_server(service, server)
    server.add_insecure_port(f"unix:{socket_path}")
    server.start()
    try:
        yield service
    finally:
        server.stop(None).wait(WAIT)
        pool.shutdown(wait=True)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Say how many gRPC fuzz cases this session ran (issue 7 asks for the figure)."""
    from tests.reliability.grpc_fuzz import SESSION, summary

    if SESSION.cases:
        terminalreporter.write_line(summary(SESSION))
