"""`gpu-extender serve --leader-elect` as real processes on the fake apiserver: a standby answers 503 and binds
nothing; a crashed leader's Lease is taken once it expires, a stopped one's at once; the new leader refuses GPUs the
old one bound."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.extender.conftest import A100, topo
from tests.fakes.kubeapi import FakeLeasesKubeApi
from tests.helpers.kube import PREFIX, k8s_node, k8s_pod
from tests.helpers.polling import eventually
from tests.helpers.processes import ExtenderProcess
from tests.helpers.scheduler import bind_body, cache_args

pytestmark = pytest.mark.timeout(120)

NS = "gpu-topology"
LEASE, RENEW, RETRY = 3, 2, 1
FLAGS = ("--leader-elect", "--leader-elect-namespace", NS, "--leader-elect-lease-duration", str(LEASE),
         "--leader-elect-renew-deadline", str(RENEW), "--leader-elect-retry-period", str(RETRY))


@pytest.fixture
def leases() -> Iterator[FakeLeasesKubeApi]:
    with FakeLeasesKubeApi() as server:
        yield server


def _start(fake: FakeLeasesKubeApi, name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ExtenderProcess:
    fake.add_pod({"metadata": {"name": name, "namespace": NS},
                  "spec": {"containers": [{"name": "extender", "image": "registry.invalid/x:0"}]}})
    monkeypatch.setenv("POD_NAME", name)  # the downward API's, read at start
    return ExtenderProcess(fake.url, tmp_path / f"{name}.log", 20.0, *FLAGS)


def _role(fake: FakeLeasesKubeApi, name: str) -> str | None:
    return ((fake.pod(NS, name) or {}).get("metadata", {}).get("labels") or {}).get(f"{PREFIX}/extender-role")


def _bindings(fake: FakeLeasesKubeApi) -> int:
    return sum(1 for r in fake.requests if r.method == "POST" and r.path.endswith("/binding"))


def test_replicas_hand_over_on_crash_and_on_stop_and_never_bind_twice(
        leases: FakeLeasesKubeApi, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    leases.add_node(k8s_node("n1", topo(A100)))
    p1, p2 = leases.add_pod(k8s_pod("p1", 8)), leases.add_pod(k8s_pod("p2", 8))
    started: list[ExtenderProcess] = []
    try:
        a = _start(leases, "ext-a", tmp_path, monkeypatch)
        started.append(a)
        assert eventually(lambda: a.gauge("gpu_extender_leader") == 1.0, 10)
        b = _start(leases, "ext-b", tmp_path, monkeypatch)
        started.append(b)
        assert eventually(lambda: _role(leases, "ext-a") == "leader" and _role(leases, "ext-b") == "standby", 10)

        r = b.http.post("/filter", json=cache_args(p1, ["n1"]))
        assert r.status_code == 503 and "held by ext-a_" in r.json()["Error"]
        assert b.http.post("/bind", json=bind_body(p1, "n1")).status_code == 503
        assert _bindings(leases) == 0
        assert a.http.post("/filter", json=cache_args(p1, ["n1"])).json()["NodeNames"] == ["n1"]
        assert a.http.post("/bind", json=bind_body(p1, "n1")).json() == {"Error": ""}
        assert _bindings(leases) == 1

        # a crash: nothing releases the Lease, so b waits it out, then takes over
        crashed = time.monotonic()
        a.stop(signal.SIGKILL)
        assert eventually(lambda: b.gauge("gpu_extender_leader") == 1.0, LEASE + RETRY + 6)
        waited = time.monotonic() - crashed
        assert waited >= 1.0, f"b took a live lease after {waited:.1f} s"
        assert eventually(lambda: _role(leases, "ext-b") == "leader", 5)
        out = b.http.post("/filter", json=cache_args(p2, ["n1"])).json()
        assert out["NodeNames"] == [], out  # p1's plan, seen by b's own watches, holds the GPUs
        assert b.http.post("/bind", json=bind_body(p2, "n1")).json()["Error"]
        assert _bindings(leases) == 1

        # a drain or upgrade: SIGTERM releases the Lease, and the standby takes over within a retry period
        c = _start(leases, "ext-c", tmp_path, monkeypatch)
        started.append(c)
        assert eventually(lambda: _role(leases, "ext-c") == "standby", 10)
        stopped = time.monotonic()
        # a graceful shutdown, after which uvicorn raises SIGTERM again: the status is 0 or -SIGTERM
        assert b.stop(signal.SIGTERM) in (0, -signal.SIGTERM)
        assert "extender.service.stopped" in b.log.read_text(errors="replace")
        assert eventually(lambda: c.gauge("gpu_extender_leader") == 1.0, RETRY + 3)
        assert time.monotonic() - stopped < RETRY + 3
        assert _role(leases, "ext-b") == "standby"
        assert c.http.post("/filter", json=cache_args(p2, ["n1"])).json()["NodeNames"] == []
    finally:
        for process in started:
            if process.proc.poll() is None:
                process.stop(signal.SIGTERM)
