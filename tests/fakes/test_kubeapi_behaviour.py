"""Parts of the fake apiserver that the client helpers do not reach: JSON patch, create/delete, fault injection."""

from __future__ import annotations

import json

import urllib3

from tests.helpers.kube import k8s_node, k8s_pod

JSON_PATCH = {"Content-Type": "application/json-patch+json"}


def call(fake, method: str, path: str, body=None, headers=None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    resp = urllib3.request(method, fake.url + path, body=data, headers=headers or {}, retries=False)
    return resp.status, json.loads(resp.data)


def test_json_patch_add_replace_remove_test(fake):
    fake.add_node(k8s_node("n", annotations={"a": "1"}))
    ops = [{"op": "test", "path": "/metadata/annotations/a", "value": "1"},
           {"op": "replace", "path": "/metadata/annotations/a", "value": "2"},
           {"op": "add", "path": "/metadata/annotations/gpu-topology.io~1state", "value": "{}"},
           {"op": "remove", "path": "/metadata/labels/kubernetes.io~1hostname"}]
    status, body = call(fake, "PATCH", "/api/v1/nodes/n", ops, JSON_PATCH)
    assert status == 200
    assert body["metadata"]["annotations"] == {"a": "2", "gpu-topology.io/state": "{}"}
    assert body["metadata"]["labels"] == {}


def test_json_patch_errors(fake):
    fake.add_node(k8s_node("n"))
    rv = fake.resource_version
    status, body = call(fake, "PATCH", "/api/v1/nodes/n",
                        [{"op": "remove", "path": "/metadata/annotations/missing"}], JSON_PATCH)
    assert status == 422 and body["reason"] == "Invalid"
    assert "doc is missing" in body["details"]["causes"][0]["message"]
    status, body = call(fake, "PATCH", "/api/v1/nodes/n", [{"op": "test", "path": "/metadata/name", "value": "x"}],
                        JSON_PATCH)
    assert status == 422 and "test failed" in body["details"]["causes"][0]["message"]
    status, body = call(fake, "PATCH", "/api/v1/nodes/n", {"metadata": {}}, JSON_PATCH)
    assert status == 400 and body["reason"] == "BadRequest"
    assert fake.resource_version == rv  # nothing was written


def test_merge_patch_of_wrong_shape_is_422(fake):
    fake.add_node(k8s_node("n"))
    status, body = call(fake, "PATCH", "/api/v1/nodes/n", {"metadata": {"labels": ["x"]}},
                        {"Content-Type": "application/merge-patch+json"})
    assert status == 422 and body["details"]["causes"][0]["field"] == "patch"


def test_main_resource_patch_ignores_status_but_status_subresource_applies_it(fake):
    fake.add_node(k8s_node("n"))
    merge = {"Content-Type": "application/merge-patch+json"}
    patch = {"status": {"allocatable": {"nvidia.com/gpu": "7"}}}
    assert call(fake, "PATCH", "/api/v1/nodes/n", patch, merge)[1]["status"]["allocatable"]["nvidia.com/gpu"] == "8"
    status, body = call(fake, "PATCH", "/api/v1/nodes/n/status", patch, merge)
    assert status == 200 and body["status"]["allocatable"]["nvidia.com/gpu"] == "7"


def test_annotations_over_256k_are_invalid(fake):
    fake.add_node(k8s_node("n"))
    status, body = call(fake, "PATCH", "/api/v1/nodes/n", {"metadata": {"annotations": {"big": "x" * 262200}}},
                        {"Content-Type": "application/merge-patch+json"})
    assert status == 422 and body["details"]["causes"][0]["reason"] == "FieldValueTooLong"


def test_create_and_delete_pods_over_http(fake):
    status, created = call(fake, "POST", "/api/v1/namespaces/ns/pods", k8s_pod("p", namespace="ns"))
    assert status == 201 and created["metadata"]["namespace"] == "ns" and created["metadata"]["uid"]
    status, body = call(fake, "POST", "/api/v1/namespaces/ns/pods", k8s_pod("p", namespace="ns"))
    assert status == 409 and body["reason"] == "AlreadyExists"
    status, gone = call(fake, "DELETE", "/api/v1/namespaces/ns/pods/p")
    assert status == 200 and gone["metadata"]["uid"] == created["metadata"]["uid"]
    assert int(gone["metadata"]["resourceVersion"]) > int(created["metadata"]["resourceVersion"])
    assert call(fake, "DELETE", "/api/v1/namespaces/ns/pods/p")[0] == 404
    assert fake.pod("ns", "p") is None


def test_unknown_paths_and_methods(fake):
    status, body = call(fake, "GET", "/api/v1/services")
    assert status == 404 and body["message"] == "the server could not find the requested resource"
    status, body = call(fake, "PUT", "/api/v1/nodes/n")
    assert status == 405 and body["reason"] == "MethodNotAllowed"


def test_fail_next_counts_and_filters(fake):
    fake.add_node(k8s_node("n"))
    fake.fail_next(2, status=503, path_regex="^/api/v1/nodes/n$", method="GET")
    assert call(fake, "GET", "/api/v1/nodes")[0] == 200  # other path: untouched
    assert call(fake, "GET", "/api/v1/nodes/n")[0] == 503
    assert call(fake, "GET", "/api/v1/nodes/n")[0] == 503
    assert call(fake, "GET", "/api/v1/nodes/n")[0] == 200
    assert [r.path for r in fake.requests] == ["/api/v1/nodes"] + ["/api/v1/nodes/n"] * 3


def test_history_limit_expires_old_watch_positions():
    from tests.fakes.kubeapi import FakeKubeApi

    with FakeKubeApi(history_limit=3) as fake:
        fake.add_node(k8s_node("a"))
        start = fake.resource_version
        for i in range(5):
            fake.update_node("a", {"metadata": {"annotations": {"i": str(i)}}})
        resp = urllib3.request("GET", f"{fake.url}/api/v1/nodes?watch=true&resourceVersion={start}")
        (event,) = [json.loads(line) for line in resp.data.decode().splitlines()]
        assert event["type"] == "ERROR" and event["object"]["code"] == 410
