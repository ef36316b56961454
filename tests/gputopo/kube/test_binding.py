"""pods/binding through the official client against the fake apiserver."""

from __future__ import annotations

import pytest

from gputopo.kube import Conflict, KubeArgumentError, NotFound, ServerError, bind_pod
from tests.helpers.kube import k8s_pod


def test_bind_sets_node_and_annotations_atomically(fake, api):
    created = fake.add_pod(k8s_pod("p"))
    plan = '{"v":1,"node":"n1","containers":{"main":["GPU-0"]}}'
    bind_pod(api, namespace="default", name="p", uid=created["metadata"]["uid"], node="n1",
             annotations={"gpu-topology.io/plan": plan, "gpu-topology.io/allreduce-gbps": "300.0"})
    bound = fake.pod("default", "p")
    assert bound["spec"]["nodeName"] == "n1"
    assert bound["metadata"]["annotations"] == {"gpu-topology.io/plan": plan,
                                                "gpu-topology.io/allreduce-gbps": "300.0"}
    assert bound["status"]["conditions"][0]["type"] == "PodScheduled"
    assert bound["status"]["conditions"][0]["status"] == "True"
    # one write: nodeName and annotations arrive in the same resourceVersion
    assert int(bound["metadata"]["resourceVersion"]) == int(created["metadata"]["resourceVersion"]) + 1
    assert [(r.method, r.path) for r in fake.requests] == [("POST", "/api/v1/namespaces/default/pods/p/binding")]


def test_bind_already_bound_is_conflict(fake, api):
    fake.add_pod(k8s_pod("p", node="n2"))
    with pytest.raises(Conflict) as exc:
        bind_pod(api, namespace="default", name="p", uid=None, node="n1", annotations={})
    assert exc.value.message == ('Operation cannot be fulfilled on pods/binding "p": pod p is already assigned '
                                 'to node "n2"')
    assert fake.pod("default", "p")["spec"]["nodeName"] == "n2"


def test_bind_missing_pod_is_not_found(fake, api):
    with pytest.raises(NotFound) as exc:
        bind_pod(api, namespace="default", name="does-not-exist", uid=None, node="n1", annotations={})
    assert exc.value.body["details"] == {"name": "does-not-exist", "kind": "pods"}


def test_bind_recreated_pod_with_stale_uid_is_conflict(fake, api):
    old_uid = fake.add_pod(k8s_pod("p"))["metadata"]["uid"]
    fake.delete_pod("default", "p")
    fake.add_pod(k8s_pod("p"))
    with pytest.raises(Conflict) as exc:
        bind_pod(api, namespace="default", name="p", uid=old_uid, node="n1", annotations={"a": "b"})
    assert "Precondition failed: UID in precondition" in exc.value.message
    assert "nodeName" not in fake.pod("default", "p")["spec"]


def test_bind_server_error_is_typed_and_changes_nothing(fake, api):
    fake.add_pod(k8s_pod("p"))
    fake.fail_next(1, status=500, path_regex="/binding$")
    with pytest.raises(ServerError):
        bind_pod(api, namespace="default", name="p", uid=None, node="n1", annotations={})
    assert "nodeName" not in fake.pod("default", "p")["spec"]
    bind_pod(api, namespace="default", name="p", uid=None, node="n1", annotations={})
    assert fake.pod("default", "p")["spec"]["nodeName"] == "n1"


def test_bind_refuses_bad_arguments_locally(fake, api):
    with pytest.raises(KubeArgumentError):
        bind_pod(api, namespace="default", name="p", uid=None, node="", annotations={})
    with pytest.raises(KubeArgumentError):
        bind_pod(api, namespace="default", name="p", uid=None, node="n", annotations={"a": 1})  # type: ignore[dict-item]
    assert fake.requests == []
