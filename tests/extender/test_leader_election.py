"""`serve --leader-elect`: two extenders on one cluster (the fake apiserver with Leases), each behind its own HTTP
server as two replicas behind a Service would be. Only the Lease holder answers and binds; the standby is ready
(synced) but answers 503 and posts no Binding; the role label on each replica's Pod follows the Lease; a stopped
leader hands over, and the new one already knows what the old one bound."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

from extender.config import ExtenderConfig
from extender.service import Extender
from gputopo.kube import make_api_client
from tests.extender.conftest import A100, running, topo
from tests.fakes.kubeapi import FakeLeasesKubeApi
from tests.helpers.kube import PREFIX, k8s_node, k8s_pod
from tests.helpers.polling import eventually
from tests.helpers.scheduler import bind_body, cache_args

NS = "gpu-topology"
ROLE = f"{PREFIX}/extender-role"
SYNC_OPTIONS = {"watch_timeout_s": 60, "backoff_initial_s": 0.02, "backoff_max_s": 0.1}
ELECTION = {"leader_elect": True, "leader_elect_namespace": NS, "leader_elect_lease_duration_s": 3,
            "leader_elect_renew_deadline_s": 2, "leader_elect_retry_period_s": 1}


@pytest.fixture
def leases() -> Iterator[FakeLeasesKubeApi]:
    with FakeLeasesKubeApi() as server:
        yield server


def _replica(stack: ExitStack, fake: FakeLeasesKubeApi, name: str, monkeypatch: pytest.MonkeyPatch,
             **election: int) -> tuple[Extender, httpx.Client, ExitStack]:
    fake.add_pod({"metadata": {"name": name, "namespace": NS, "labels": {"app": "gpu-extender"}},
                  "spec": {"containers": [{"name": "extender", "image": "registry.invalid/x:0"}]}})
    monkeypatch.setenv("POD_NAME", name)
    api = make_api_client(host=fake.url, timeout_s=5.0)
    stack.callback(api.close)
    ext = Extender.cluster(api, ExtenderConfig(**{**ELECTION, **election}, leader_elect_identity=name),
                           sync_options=SYNC_OPTIONS)
    own = ExitStack()
    client = own.enter_context(running(ext))
    stack.enter_context(own)
    return ext, client, own


def _role(fake: FakeLeasesKubeApi, name: str) -> str | None:
    pod = fake.pod(NS, name) or {}
    return pod.get("metadata", {}).get("labels", {}).get(ROLE)


def _bindings(fake: FakeLeasesKubeApi) -> int:
    return sum(1 for r in fake.requests if r.method == "POST" and r.path.endswith("/binding"))


def test_only_the_lease_holder_answers_and_binds_and_a_stopped_one_hands_over(
        leases: FakeLeasesKubeApi, monkeypatch: pytest.MonkeyPatch) -> None:
    leases.add_node(k8s_node("n1", topo(A100)))
    p1, p2 = leases.add_pod(k8s_pod("p1", 8)), leases.add_pod(k8s_pod("p2", 8))
    with ExitStack() as stack:
        a, client_a, stop_a = _replica(stack, leases, "ext-a", monkeypatch)
        eventually(lambda: a.leading(), 10)
        b, client_b, _ = _replica(stack, leases, "ext-b", monkeypatch)
        eventually(lambda: _role(leases, "ext-a") == "leader" and _role(leases, "ext-b") == "standby", 10)
        assert b.leadership is not None
        assert eventually(lambda: b.leadership.elector.holder() == "ext-a", 10)  # the standby has seen the Lease

        # the standby: ready (a disruption budget counts it), but it neither plans nor binds
        assert client_b.get("/readyz").status_code == 200 and not b.leading()
        for verb, body in (("filter", cache_args(p1, ["n1"])), ("prioritize", cache_args(p1, ["n1"])),
                           ("bind", bind_body(p1, "n1")), ("preempt", {"Pod": p1, "NodeNameToMetaVictims": {}})):
            r = client_b.post(f"/{verb}", json=body)
            assert r.status_code == 503, verb
            assert "only the holder of the Lease gpu-topology/gpu-extender answers (held by ext-a)" in r.json()["Error"]
        assert _bindings(leases) == 0 and b.reservations.count() == 0
        assert 'gpu_extender_leader 0.0' in client_b.get("/metrics").text

        # the leader answers and binds
        assert client_a.post("/filter", json=cache_args(p1, ["n1"])).json()["NodeNames"] == ["n1"]
        assert client_a.post("/bind", json=bind_body(p1, "n1")).json() == {"Error": ""}
        assert _bindings(leases) == 1
        assert 'gpu_extender_leader 1.0' in client_a.get("/metrics").text

        # the leader stops (a drain, an upgrade): the standby takes over within a retry period, and its own
        # watches already hold p1's plan, so p1's GPUs are not offered again
        stop_a.close()
        assert leases.holder(NS, "gpu-extender") is None or leases.holder(NS, "gpu-extender") == "ext-b"
        eventually(lambda: b.leading(), 3)
        eventually(lambda: _role(leases, "ext-b") == "leader" and _role(leases, "ext-a") == "standby", 5)
        out = client_b.post("/filter", json=cache_args(p2, ["n1"])).json()
        assert out["NodeNames"] == [] and "GPU 0-7" in out["FailedNodes"]["n1"], out
        r = client_b.post("/bind", json=bind_body(p2, "n1"))
        assert r.status_code == 200 and r.json()["Error"], r.json()  # refused: the GPUs are p1's
        assert _bindings(leases) == 1


def test_election_settings_are_checked_like_every_other_setting() -> None:
    with pytest.raises(ValueError, match="must be longer than the renew deadline"):
        ExtenderConfig(leader_elect=True, leader_elect_lease_duration_s=5, leader_elect_renew_deadline_s=5)
    with pytest.raises(ValueError, match="needs a cluster"):
        ExtenderConfig(leader_elect=True, inventory=__file__)


def test_without_election_every_replica_answers(leases: FakeLeasesKubeApi) -> None:
    api = make_api_client(host=leases.url, timeout_s=5.0)
    try:
        ext = Extender.cluster(api, ExtenderConfig(), sync_options=SYNC_OPTIONS)
        assert ext.leadership is None and ext.leading()
        with running(ext) as client:
            assert 'gpu_extender_leader 1.0' in client.get("/metrics").text
        assert leases.lease(NS, "gpu-extender") is None
    finally:
        api.close()


def test_a_leader_stepping_down_writes_its_started_binds_before_it_releases_the_lease(
        leases: FakeLeasesKubeApi, monkeypatch: pytest.MonkeyPatch) -> None:
    """The order that keeps a GPU from being given twice across a handover: stop answering, let the binds already
    posted end under the Lease, then release it."""
    import threading

    leases.add_node(k8s_node("n1", topo(A100)))
    p1 = leases.add_pod(k8s_pod("p1", 4))
    with ExitStack() as stack:
        a, client_a, _ = _replica(stack, leases, "ext-a", monkeypatch, leader_elect_lease_duration_s=6,
                                  leader_elect_renew_deadline_s=4)
        assert eventually(lambda: a.leading(), 10)
        gate = leases.hold_next(1, path_regex=r"/binding$")
        answered: list[httpx.Response] = []
        bind = threading.Thread(target=lambda: answered.append(client_a.post("/bind", json=bind_body(p1, "n1"))))
        bind.start()
        assert leases.wait_until(lambda: _bindings(leases) == 1, 10)  # the POST is out, held by the apiserver
        assert a.leadership is not None
        stepping_down = threading.Thread(target=a.leadership.stop)  # what SIGTERM does first
        stepping_down.start()
        assert eventually(lambda: not a.leading(), 2)
        # answers nothing more: a verb asked while it hands over is held until the handover ends, then refused
        refused: list[int] = []
        asking = threading.Thread(target=lambda: refused.append(
            client_a.post("/filter", json=cache_args(p1, ["n1"])).status_code))
        asking.start()
        time.sleep(1.5)  # longer than a retry period: the Lease is still held, and renewed
        assert leases.holder(NS, "gpu-extender") == "ext-a"
        gate.set()
        bind.join(10)
        stepping_down.join(10)
        assert answered and answered[0].json() == {"Error": ""}
        assert leases.holder(NS, "gpu-extender") is None  # released only after the bind was written
        assert leases.pod("default", "p1")["spec"].get("nodeName") == "n1"
        asking.join(10)
        assert refused == [503]
