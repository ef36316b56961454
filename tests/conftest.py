"""Fixtures the whole suite shares (helpers to import are in tests/helpers/): `shared_dir` is the read-only fixture
tree (../shared next to the repository); `fake` is an in-process kube-apiserver and `api` the official client
pointed at it; `kubelet` is the kubelet simulator serving on `plugin_dir` (a directory short enough for unix socket
paths)."""

import threading
from collections.abc import Iterator
from pathlib import Path

import kubernetes.client
import pytest

from gputopo.kube import make_api_client
from sim.kubelet import KubeletSimulator
from tests.fakes.kubeapi import FakeKubeApi
from tests.helpers.paths import SHARED, short_dir


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    assert SHARED.is_dir(), f"shared fixtures not found at {SHARED}"
    return SHARED


@pytest.fixture
def fake() -> Iterator[FakeKubeApi]:
    with FakeKubeApi() as server:
        yield server


@pytest.fixture
def api(fake: FakeKubeApi) -> Iterator[kubernetes.client.ApiClient]:
    client = make_api_client(host=fake.url, timeout_s=5.0)
    yield client
    client.close()


@pytest.fixture
def plugin_dir() -> Iterator[Path]:
    """A device plugin directory short enough for unix socket paths."""
    with short_dir("dp-") as path:
        yield path


@pytest.fixture
def kubelet(plugin_dir: Path) -> Iterator[KubeletSimulator]:
    sim = KubeletSimulator(plugin_dir).start()
    yield sim
    sim.stop()


def process_wide(thread: threading.Thread) -> bool:
    """grpc.aio's completion-queue poller: started by the first aio server of the process and kept for its life
    (the device plugin's gRPC server is grpc.aio), so not a leak of the test that happened to start it."""
    return thread.name.endswith("(_poll_wrapper)")


@pytest.fixture
def no_leaked_threads() -> Iterator[None]:
    """Fails a test that leaves threads running; suites that start servers and watchers use it autouse."""
    before = set(threading.enumerate())
    yield
    leftover = [t for t in threading.enumerate() if t not in before and not process_wide(t)]
    for t in leftover:
        t.join(5)
    alive = [t.name for t in leftover if t.is_alive()]
    assert not alive, f"threads left running: {alive}"
