"""Fixtures the whole suite shares (helpers to import are in tests/helpers/): `fixtures_dir` is the read-only tree of
recorded facts (fixtures/ in the repository); `fake` is an in-process kube-apiserver and `api` the official client
pointed at it; `kubelet` is the kubelet simulator serving on `plugin_dir` (a directory short enough for unix socket
paths). Every run ends by checking that no test wrote under fixtures/."""

import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import kubernetes.client
import pytest
import structlog

from gputopo.kube import make_api_client
from sim.kubelet import KubeletSimulator
from tests.fakes.kubeapi import FakeKubeApi
from tests.helpers.paths import SHARED, fixture_changes, fixture_manifest, short_dir

# Every process a test starts inherits this: one that hangs and is aborted (tests.helpers.processes.stop_process)
# writes its threads' stacks first.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


@pytest.fixture(scope="session", autouse=True)
def fixtures_untouched() -> Iterator[None]:
    """The recordings are facts: a test that edits, adds or removes one fails the run (at its end, since the damage
    can come from any test), instead of quietly changing what every later test checks against. Root ignores file
    modes, so read-only permissions could not enforce this on CI's containers; the content hashes can."""
    before = fixture_manifest()
    yield
    changes = fixture_changes(before, fixture_manifest())
    assert not changes, f"tests wrote under {SHARED} (recorded facts, read-only): {changes}"


@pytest.fixture(autouse=True)
def logging_restored() -> Iterator[None]:
    """A command run in-process configures logging for the process (gputopo.logs.configure_logging: a level filter,
    a stream, the root handlers); left so, a later test's `structlog.testing.capture_logs` misses every event under
    that level, so which tests pass would depend on their order. Each test starts from the configuration before."""
    config = structlog.get_config()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    structlog.configure(**config)
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    assert SHARED.is_dir(), f"recorded fixtures not found at {SHARED}"
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
