"""get/list of Nodes and Pods through the official client against the fake apiserver."""

from __future__ import annotations

import socket

import pytest
import urllib3

from gputopo.kube import (
    ApiUnavailable,
    BadRequest,
    Forbidden,
    KubeArgumentError,
    NotFound,
    ServerError,
    Unauthorized,
    get_node,
    get_pod,
    list_nodes,
    list_pods,
    make_api_client,
)
from tests.fakes.kubeapi import FakeKubeApi
from tests.helpers.kube import k8s_node, k8s_pod


def test_get_node_returns_plain_dict(fake, api):
    fake.add_node(k8s_node("gpu-node-1", annotations={"a": "b"}))
    got = get_node(api, "gpu-node-1")
    assert type(got) is dict
    assert got["kind"] == "Node"
    assert got["metadata"]["name"] == "gpu-node-1"
    assert got["metadata"]["annotations"] == {"a": "b"}
    assert got["status"]["allocatable"]["nvidia.com/gpu"] == "8"


def test_get_missing_node_and_pod_raise_not_found(fake, api):
    with pytest.raises(NotFound) as exc:
        get_node(api, "no-such-node")
    assert exc.value.status == 404
    assert exc.value.reason == "NotFound"
    assert exc.value.message == 'nodes "no-such-node" not found'
    assert exc.value.body["details"] == {"name": "no-such-node", "kind": "nodes"}
    with pytest.raises(NotFound):
        get_pod(api, "default", "does-not-exist")


def test_get_pod(fake, api):
    fake.add_pod(k8s_pod("p1", namespace="team-a"))
    got = get_pod(api, "team-a", "p1")
    assert got["metadata"]["namespace"] == "team-a"
    assert got["status"]["phase"] == "Pending"


def test_list_nodes_follows_continue_pages(fake, api):
    for i in range(7):
        fake.add_node(k8s_node(f"n{i}"))
    items, rv = list_nodes(api, limit=3)
    assert [i["metadata"]["name"] for i in items] == [f"n{i}" for i in range(7)]
    assert rv == fake.resource_version
    lists = [r for r in fake.requests if r.path == "/api/v1/nodes"]
    assert len(lists) == 3
    assert "continue" not in lists[0].query
    assert all("continue" in r.query and r.query["limit"] == "3" for r in lists[1:])


def test_list_pages_are_one_consistent_snapshot(fake):
    for i in range(4):
        fake.add_node(k8s_node(f"n{i}"))
    first = urllib3.request("GET", f"{fake.url}/api/v1/nodes?limit=2").json()
    fake.update_node("n3", {"metadata": {"labels": {"late": "yes"}}})
    token = first["metadata"]["continue"]
    second = urllib3.request("GET", f"{fake.url}/api/v1/nodes?limit=2&continue={token}").json()
    assert second["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    assert [i["metadata"]["name"] for i in second["items"]] == ["n2", "n3"]
    assert "late" not in second["items"][1]["metadata"]["labels"]
    assert "continue" not in second["metadata"]


def test_expired_continue_restarts_with_one_unpaged_list(fake, api):
    for i in range(5):
        fake.add_node(k8s_node(f"n{i}"))
    fake.fail_next(1, status=410, path_regex="continue=")
    items, _ = list_nodes(api, limit=2)
    assert [i["metadata"]["name"] for i in items] == [f"n{i}" for i in range(5)]
    last = [r for r in fake.requests if r.path == "/api/v1/nodes"][-1]
    assert "limit" not in last.query and "continue" not in last.query


def test_list_with_label_selector(fake, api):
    fake.add_node(k8s_node("a", labels={"nvidia.com/gpu.present": "true"}))
    fake.add_node(k8s_node("b"))
    fake.add_node(k8s_node("c", labels={"nvidia.com/gpu.present": "true", "pool": "x"}))
    names = lambda sel: [i["metadata"]["name"] for i in list_nodes(api, label_selector=sel)[0]]  # noqa: E731
    assert names("nvidia.com/gpu.present=true") == ["a", "c"]
    assert names("!nvidia.com/gpu.present") == ["b"]
    assert names("pool in (x,y)") == ["c"]
    assert names("nvidia.com/gpu.present=true,pool!=x") == ["a"]
    with pytest.raises(BadRequest) as exc:
        list_nodes(api, label_selector="app==(x")
    assert "unable to parse requirement" in exc.value.message


def test_list_pods_field_selectors_and_namespace(fake, api):
    fake.add_pod(k8s_pod("bound", node="n1"))
    fake.add_pod(k8s_pod("unbound"))
    fake.add_pod(k8s_pod("other-ns", namespace="b", node="n1"))
    fake.add_pod(k8s_pod("done", node="n1"))
    fake.update_pod("default", "done", {"status": {"phase": "Succeeded"}})
    names = lambda **kw: sorted(i["metadata"]["name"] for i in list_pods(api, **kw)[0])  # noqa: E731
    assert names(field_selector="spec.nodeName=n1") == ["bound", "done", "other-ns"]
    assert names(field_selector="spec.nodeName=n1,status.phase!=Succeeded") == ["bound", "other-ns"]
    assert names(field_selector="spec.nodeName=,status.phase!=Succeeded,status.phase!=Failed") == ["unbound"]
    assert names(namespace="b") == ["other-ns"]
    assert names(namespace="default", limit=1) == ["bound", "done", "unbound"]
    with pytest.raises(BadRequest) as exc:
        list_pods(api, field_selector="spec.foo=bar")
    assert exc.value.message == "field label not supported: spec.foo"


def test_list_items_have_no_kind_like_the_apiserver(fake, api):
    fake.add_node(k8s_node("n"))
    items, _ = list_nodes(api)
    assert "kind" not in items[0] and items[0]["metadata"]["name"] == "n"


def test_server_errors_are_typed(fake, api):
    fake.add_node(k8s_node("n"))
    fake.fail_next(1, status=500)
    with pytest.raises(ServerError) as exc:
        get_node(api, "n")
    assert exc.value.retryable and exc.value.reason == "InternalError"
    fake.fail_next(1, status=403)
    with pytest.raises(Forbidden):
        list_nodes(api)
    assert get_node(api, "n")["metadata"]["name"] == "n"


def test_bearer_token_is_sent_and_checked():
    with FakeKubeApi(token="s3cret") as fake:
        fake.add_node(k8s_node("n"))
        good = make_api_client(host=fake.url, token="s3cret")
        bad = make_api_client(host=fake.url, token="wrong")
        try:
            assert get_node(good, "n")["metadata"]["name"] == "n"
            with pytest.raises(Unauthorized) as exc:
                get_node(bad, "n")
            assert exc.value.body == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                      "message": "Unauthorized", "reason": "Unauthorized", "code": 401}
        finally:
            good.close()
            bad.close()


def test_unreachable_server_is_api_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = make_api_client(host=f"http://127.0.0.1:{port}", timeout_s=1.0)
    try:
        with pytest.raises(ApiUnavailable) as exc:
            get_node(client, "n")
        assert exc.value.status == 0 and exc.value.retryable
    finally:
        client.close()


def test_slow_server_times_out_as_api_unavailable(fake):
    fake.add_node(k8s_node("n"))
    fake.delay_next(1, 3.0)
    client = make_api_client(host=fake.url, timeout_s=0.3)
    try:
        with pytest.raises(ApiUnavailable):
            get_node(client, "n")
    finally:
        client.close()


def test_bad_arguments_are_refused_before_any_request(fake, api):
    with pytest.raises(KubeArgumentError):
        get_node(api, "")
    with pytest.raises(KubeArgumentError):
        list_nodes(api, limit=0)
    assert fake.requests == []
