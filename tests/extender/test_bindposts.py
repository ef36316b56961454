"""The bind worker process (extender.bindposts): binds are posted from it, a dead one is restarted, and the POSTs
it held when it died keep their GPUs reserved (the apiserver may still apply them)."""

from __future__ import annotations

import os
import signal
import threading

from extender.config import ExtenderConfig
from extender.service import Extender
from gputopo.contract import parse_plan
from tests.extender.conftest import A100, running, topo
from tests.extender.test_cluster import PLAN, SYNC_OPTIONS, filter_names
from tests.fakes.kubeapi import FakeKubeApi
from tests.helpers.kube import k8s_node, k8s_pod
from tests.helpers.polling import eventually
from tests.helpers.scheduler import bind_body


def test_binds_are_posted_by_a_worker_process_that_is_restarted_when_it_dies(fake: FakeKubeApi, api) -> None:
    fake.add_node(k8s_node("n1", topo(A100)))
    p1, p2 = fake.add_pod(k8s_pod("p1", 2)), fake.add_pod(k8s_pod("p2", 2))
    ext = Extender.cluster(api, ExtenderConfig(), sync_options=SYNC_OPTIONS)
    with running(ext) as client:
        assert ext.posts is not None
        first = ext.posts.pid
        assert first is not None and first != os.getpid()
        assert client.post("/bind", json=bind_body(p1, "n1")).json() == {"Error": ""}
        assert fake.pod("default", "p1")["spec"]["nodeName"] == "n1"

        os.kill(first, signal.SIGKILL)
        eventually(lambda: ext.posts.pid not in (None, first) and ext.posts.ready, 20, interval=0.02)
        assert client.get("/readyz").status_code == 200
        assert client.post("/bind", json=bind_body(p2, "n1")).json() == {"Error": ""}
        assert fake.pod("default", "p2")["spec"]["nodeName"] == "n1"
        assert ext.posts.starts == 2
        assert "gpu_extender_bind_worker_starts_total 2.0" in client.get("/metrics").text
    assert not ext.posts.running and ext.posts.pid is None


def test_a_post_held_by_a_worker_that_died_keeps_its_gpus_reserved(fake: FakeKubeApi, api) -> None:
    fake.add_node(k8s_node("n1", topo(A100)))
    p1, p2 = fake.add_pod(k8s_pod("p1", 6)), fake.add_pod(k8s_pod("p2", 6))
    ext = Extender.cluster(api, ExtenderConfig(), sync_options=SYNC_OPTIONS)
    with running(ext) as client:
        assert ext.posts is not None
        gate = fake.hold_next(1, path_regex="/binding")
        answer: dict[str, object] = {}
        binder = threading.Thread(target=lambda: answer.update(client.post("/bind", json=bind_body(p1, "n1")).json()))
        binder.start()
        eventually(lambda: any(r.path.endswith("/binding") for r in fake.requests), 10, interval=0.01)
        worker = ext.posts.pid
        assert worker is not None
        os.kill(worker, signal.SIGKILL)
        binder.join(20)
        error = str(answer["Error"])
        assert "BindWorkerDied" in error and "stay reserved" in error, error
        # the POST went out: until the pod is seen bound or gone, its 6 GPUs are not planned for p2
        assert ext.reservations.count() == 1
        reason = filter_names(client, p2, ["n1"])["FailedNodes"]["n1"]
        assert "reserved for pods being bound" in reason, reason

        gate.set()  # the apiserver applies the Binding after all: the reservation becomes the pod's own plan
        eventually(lambda: (fake.pod("default", "p1") or {}).get("spec", {}).get("nodeName") == "n1", 10)
        plan = parse_plan(fake.pod("default", "p1")["metadata"]["annotations"][PLAN])
        assert ext.cache.wait_for(lambda: (rec := ext.cache.pods.get(p1["metadata"]["uid"])) is not None
                                  and rec.node == "n1", 10)
        assert len(plan.ids) == 6
        assert "n1" not in filter_names(client, p2, ["n1"])["NodeNames"]
