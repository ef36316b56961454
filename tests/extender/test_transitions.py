"""The instants between steady states, on the fake apiserver: an extender that (re)starts answers no verb until its
view is whole, a follower takes a released Lease at once, and a replica whose account may not use its Lease says so
and is not ready. The same instants against the real kube-apiserver and kube-scheduler: tests/integration/
test_extender_failover_real.py and bench/failover.py."""

from __future__ import annotations

import threading
from contextlib import ExitStack

import pytest
import structlog

from extender.config import ExtenderConfig
from extender.service import Extender
from gputopo.contract import parse_plan
from gputopo.kube import make_api_client
from tests.extender.conftest import A100, running, topo
from tests.extender.test_cluster import PLAN, SYNC_OPTIONS
from tests.extender.test_leader_election import ELECTION, _replica, leases  # noqa: F401 (fixture)
from tests.fakes.kubeapi import FakeKubeApi, FakeLeasesKubeApi
from tests.helpers.kube import k8s_node, k8s_pod
from tests.helpers.polling import eventually
from tests.helpers.scheduler import bind_body, cache_args

VERBS = ("filter", "prioritize", "bind", "preempt")
POD_LIST = r"^/api/v1/pods\?(?!.*watch=)"  # the pod watch's first list, not its watch requests


def _bodies(pod: dict) -> dict[str, dict]:
    return {"filter": cache_args(pod, ["n1"]), "prioritize": cache_args(pod, ["n1"]), "bind": bind_body(pod, "n1"),
            "preempt": {"Pod": pod, "NodeNameToMetaVictims": {}}}


def test_a_restarted_extender_answers_no_verb_until_it_has_read_the_bound_pods(fake: FakeKubeApi, api) -> None:
    """Before the pod list is in, the view lacks p1's plan: a bind from it handed p1's GPUs to p2 as well."""
    fake.add_node(k8s_node("n1", topo(A100)))
    p1, p2 = fake.add_pod(k8s_pod("p1", 6)), fake.add_pod(k8s_pod("p2", 6))
    first = Extender.cluster(api, ExtenderConfig(), sync_options=SYNC_OPTIONS)
    with running(first) as client:
        assert eventually(lambda: client.get("/readyz").status_code == 200, 10)
        assert client.post("/bind", json=bind_body(p1, "n1")).json() == {"Error": ""}
    held = set(parse_plan(fake.pod("default", "p1")["metadata"]["annotations"][PLAN]).ids)

    gate = fake.hold_next(1, path_regex=POD_LIST)  # the restarted extender's pod list is slow to come
    again = Extender.cluster(api, ExtenderConfig(), sync_options=SYNC_OPTIONS)
    with running(again) as client:
        assert fake.wait_for_requests(lambda r: r.method == "GET" and r.path == "/api/v1/pods"
                                      and "watch" not in r.query, 1, 10)
        for verb, body in _bodies(p2).items():
            r = client.post(f"/{verb}", json=body)
            assert r.status_code == 503, (verb, r.text)
            assert "not ready: the view is not complete yet" in r.json()["Error"], r.json()
        ready = client.get("/readyz")
        assert ready.status_code == 503 and "pods" in ready.text, ready.text
        assert not (fake.pod("default", "p2")["spec"].get("nodeName"))

        gate.set()
        assert eventually(lambda: client.get("/readyz").status_code == 200, 10)
        out = client.post("/filter", json=cache_args(p2, ["n1"])).json()
        assert out["NodeNames"] == [], out  # 2 GPUs free: p1's 6 are known now
        assert client.post("/bind", json=bind_body(p2, "n1")).json()["Error"]
    assert not (fake.pod("default", "p2")["spec"].get("nodeName"))
    assert len(held) == 6


def test_a_follower_takes_a_released_lease_at_once_not_at_its_next_try(
        leases: FakeLeasesKubeApi, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Retry period 20 s: without the Lease watch the follower would lead only at its next try, up to 20 s later."""
    leases.add_node(k8s_node("n1", topo(A100)))
    slow = {"leader_elect_lease_duration_s": 60, "leader_elect_renew_deadline_s": 40,
            "leader_elect_retry_period_s": 20}
    with ExitStack() as stack:
        a, _, stop_a = _replica(stack, leases, "ext-a", monkeypatch, **slow)
        assert eventually(lambda: a.leading(), 10)
        b, client_b, _ = _replica(stack, leases, "ext-b", monkeypatch, **slow)
        assert b.leadership is not None
        assert eventually(lambda: b.leadership.elector.holder() == "ext-a", 10)  # b tried once and waits its period
        closing = threading.Thread(target=stop_a.close)  # releases the Lease, then winds down
        closing.start()
        assert eventually(lambda: b.leading(), 4)
        closing.join(60)
        assert client_b.post("/filter", json=cache_args(leases.add_pod(k8s_pod("p", 2)), ["n1"])).json()[
            "NodeNames"] == ["n1"]


def test_a_verb_asked_of_a_leader_handing_over_is_answered_once_its_successor_leads(
        leases: FakeLeasesKubeApi, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Refused at once, each such verb sent kube-scheduler on to the next pod, to be refused too: dozens of pods
    waited out a back-off per handover. Held, kube-scheduler's serial cycle waits on one answer."""
    leases.add_node(k8s_node("n1", topo(A100)))
    p1, p2 = leases.add_pod(k8s_pod("p1", 2)), leases.add_pod(k8s_pod("p2", 2))
    with ExitStack() as stack:
        a, client_a, _ = _replica(stack, leases, "ext-a", monkeypatch)
        assert eventually(lambda: a.leading(), 10)
        b, _, _ = _replica(stack, leases, "ext-b", monkeypatch)
        assert b.leadership is not None and a.leadership is not None
        assert eventually(lambda: b.leadership.elector.holder() == "ext-a", 10)
        gate = leases.hold_next(1, path_regex=r"/binding$")  # a bind in flight: the handover waits for it
        bound: list[dict] = []
        binding = threading.Thread(target=lambda: bound.append(client_a.post("/bind", json=bind_body(p1, "n1")).json()))
        binding.start()
        assert leases.wait_for_requests(lambda r: r.path.endswith("/binding"), 1, 10)
        stepping_down = threading.Thread(target=a.leadership.stop)
        stepping_down.start()
        assert eventually(lambda: not a.leading(), 5)
        asked: list[tuple[int, bool]] = []
        asking = threading.Thread(target=lambda: asked.append(
            (client_a.post("/filter", json=cache_args(p2, ["n1"])).status_code, b.leading())))
        asking.start()
        gate.set()  # the bind is written, the Lease released, b takes it
        for t in (binding, stepping_down, asking):
            t.join(20)
        assert bound == [{"Error": ""}]
        assert asked == [(503, True)], asked  # refused only once the successor led


def test_a_replica_that_may_not_use_its_lease_is_not_ready_and_says_why_once(
        leases: FakeLeasesKubeApi, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    leases.add_node(k8s_node("n1", topo(A100)))
    leases.fail_next(10**6, status=403, path_regex=r"^/apis/coordination\.k8s\.io/v1/namespaces/[^/]+/leases/")
    monkeypatch.setenv("POD_NAME", "ext-a")
    api = make_api_client(host=leases.url, timeout_s=5.0)
    try:
        ext = Extender.cluster(api, ExtenderConfig(**ELECTION, leader_elect_identity="ext-a"),
                               sync_options=SYNC_OPTIONS)
        with structlog.testing.capture_logs() as logs, running(ext) as client:
            assert ext.leadership is not None
            assert eventually(lambda: ext.leadership.elector.problem is not None, 10)
            ready = client.get("/readyz")
            assert ready.status_code == 503
            assert "leader election cannot get the Lease gpu-topology/gpu-extender: 403" in ready.text, ready.text
            r = client.post("/filter", json=cache_args(leases.add_pod(k8s_pod("p", 2)), ["n1"]))
            assert r.status_code == 503 and "cannot lead" in r.json()["Error"], r.json()
            # tried again every retry period, said once
            assert leases.wait_for_requests(lambda r: "/leases/" in r.path, 3, 10)
        errors = [e for e in logs if e["event"] == "kube.election.forbidden"]
        assert len(errors) == 1 and errors[0]["log_level"] == "error", errors
    finally:
        api.close()
