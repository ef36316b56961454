"""The fake apiserver answers like the recorded kube-apiserver v1.36.2: same Status bodies, list and watch shapes.

Each test replays a recorded request (method, path, Content-Type, body) against a fake loaded with the recorded
cluster objects and compares the reply with the recorded one.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import urllib3

from tests.fakes.kubeapi import FakeKubeApi
from tests.helpers.paths import APISERVER_RECORDINGS

pytestmark = pytest.mark.skipif(not APISERVER_RECORDINGS.is_dir(), reason="recordings not available")


def load(name: str) -> dict[str, Any]:
    return json.loads((APISERVER_RECORDINGS / name).read_text())


def stream_events(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (APISERVER_RECORDINGS / name).read_text().splitlines() if line]


@pytest.fixture
def cluster(fake: FakeKubeApi) -> FakeKubeApi:
    """The recorded cluster: gpu-node-1/2 and the gpu pods, unbound ones with nodeName removed."""
    for item in load("nodes-list.json")["response"]["body"]["items"]:
        fake.add_node(item)
    for item in load("pods-list.json")["response"]["body"]["items"]:
        if item["metadata"]["name"].startswith("gpu-pod-unbound"):
            item["spec"].pop("nodeName", None)
            item["status"] = {"phase": "Pending"}
        fake.add_pod(item)
    return fake


def replay(fake: FakeKubeApi, name: str, *, body: Any = ..., content_type: Any = ...) -> urllib3.BaseHTTPResponse:
    req = load(name)["request"]
    headers = dict(req["headers"])
    ctype = headers.get("Content-Type") if content_type is ... else content_type
    raw = req["body"] if body is ... else body
    data = None
    if raw is not None:
        data = raw.encode() if isinstance(raw, str) else json.dumps(raw).encode()
    send = {"Accept": "application/json"}
    if ctype:
        send["Content-Type"] = ctype
    return urllib3.request(req["method"], fake.url + req["path"], body=data, headers=send, retries=False)


def assert_same_reply(fake: FakeKubeApi, name: str, **kw: Any) -> urllib3.BaseHTTPResponse:
    recorded = load(name)["response"]
    resp = replay(fake, name, **kw)
    assert resp.status == recorded["status"]
    assert resp.data.decode() == recorded["body_raw"]
    assert resp.headers["Content-Type"] == "application/json"
    return resp


def header_names(headers: Any) -> list[str]:
    return [k.lower() for k in headers]


@pytest.mark.parametrize("name", [
    "node-not-found.json",
    "pod-not-found.json",
    "node-patch-not-found.json",
    "pod-patch-not-found.json",
    "pod-binding-not-found.json",
    "pod-binding-name-mismatch.json",
    "node-patch-unsupported-media-415.json",
    "node-patch-invalid.json",
    "node-patch-conflict-409.json",
    "pods-list-bad-fieldselector.json",
    "pods-list-bad-labelselector.json",
    "python-client/023-create_namespaced_binding-preload-false-404.json",
])
def test_error_bodies_equal_the_recordings(cluster, name):
    resp = assert_same_reply(cluster, name)
    recorded = load(name)["response"]
    assert header_names(resp.headers) == [k.lower() for k, _ in recorded["headers"]]


def test_binding_created_then_conflict_equal_the_recordings(cluster):
    resp = assert_same_reply(cluster, "pod-binding-created.json")
    assert resp.status == 201
    bound = cluster.pod("default", "gpu-pod-unbound")
    assert bound["spec"]["nodeName"] == "gpu-node-2"
    recorded_after = load("pod-get-after-binding.json")["response"]["body"]
    assert [c["type"] for c in bound["status"]["conditions"]] == ["PodScheduled"]
    assert bound["status"]["conditions"][0].keys() == recorded_after["status"]["conditions"][0].keys()
    # the recorded conflict binds the same pod again, to gpu-node-1
    assert_same_reply(cluster, "pod-binding-conflict.json")


def test_python_client_binding_without_content_type_is_accepted(cluster):
    # kubernetes 37's create_namespaced_pod_binding sends no Content-Type and no apiVersion/kind
    assert_same_reply(cluster, "python-client/022-create_namespaced_pod_binding-preload-false.json",
                      content_type=None)
    assert cluster.pod("default", "gpu-pod-unbound3")["spec"]["nodeName"] == "gpu-node-2"


def test_unauthorized_equals_the_recording():
    with FakeKubeApi(token="right") as fake:
        resp = assert_same_reply(fake, "unauthorized-401.json")
        recorded = load("unauthorized-401.json")["response"]
        assert header_names(resp.headers) == [k.lower() for k, _ in recorded["headers"]]


def test_invalid_label_patch_matches_recorded_cause(cluster):
    recorded = load("node-patch-invalid-422.json")["response"]["body"]
    resp = replay(cluster, "node-patch-invalid-422.json")
    got = json.loads(resp.data)
    assert resp.status == 422
    assert list(got) == list(recorded)
    assert list(got["details"]) == list(recorded["details"])
    assert got["details"]["causes"][0] == recorded["details"]["causes"][0]
    assert got["message"].startswith('Node "gpu-node-1" is invalid: metadata.labels: Invalid value: ')


@pytest.mark.parametrize("name", ["node-patch-invalid-strategic.json", "pod-patch-spec-forbidden-422.json"])
def test_422_shapes_match(cluster, name):
    recorded = load(name)["response"]["body"]
    resp = replay(cluster, name)
    got = json.loads(resp.data)
    assert resp.status == 422
    assert list(got) == list(recorded)
    assert list(got["details"]) == list(recorded["details"])
    mine, theirs = got["details"]["causes"][0], recorded["details"]["causes"][0]
    assert (mine["reason"], mine["field"]) == (theirs["reason"], theirs["field"])


def test_patch_sequence_gives_the_recorded_metadata(cluster):
    # the recorded order on gpu-node-1 (after a watch test had set example.com/gpu-share=watch-test), then pods
    cluster.update_node("gpu-node-1", {"metadata": {"annotations": {"example.com/gpu-share": "watch-test"}}})
    for name in ["node-patch-merge.json", "node-patch-strategic.json", "node-patch-merge-remove.json",
                 "node-patch-json.json", "pod-patch-annotations.json", "pod-patch-annotations-merge.json"]:
        recorded = load(name)["response"]["body"]
        resp = replay(cluster, name)
        got = json.loads(resp.data)
        assert resp.status == 200, name
        assert got["metadata"].get("annotations") == recorded["metadata"].get("annotations"), name
        assert got["metadata"]["labels"] == recorded["metadata"]["labels"], name
        assert list(got)[:3] == ["kind", "apiVersion", "metadata"]
        assert got["status"] == recorded["status"] or got["kind"] == "Pod"


def test_list_metadata_and_pagination_shape(cluster):
    recorded = load("nodes-list-limit-continue.json")["response"]["body"]
    resp = replay(cluster, "nodes-list-limit-continue.json")
    got = json.loads(resp.data)
    assert list(got) == list(recorded) == ["kind", "apiVersion", "metadata", "items"]
    assert list(got["metadata"]) == list(recorded["metadata"])
    assert got["metadata"]["remainingItemCount"] == recorded["metadata"]["remainingItemCount"] == 1
    assert [i["metadata"]["name"] for i in got["items"]] == ["gpu-node-1"]
    assert list(got["items"][0]) == list(recorded["items"][0])  # items carry no kind/apiVersion
    # a reply over 2 KiB goes chunked, like Go's net/http
    big = urllib3.request("GET", cluster.url + "/api/v1/pods", retries=False)
    assert big.headers.get("Transfer-Encoding") == "chunked" and "Content-Length" not in big.headers
    assert json.loads(big.data)["kind"] == "PodList"


def test_expired_continue_equals_the_recording(cluster):
    first = json.loads(urllib3.request("GET", cluster.url + "/api/v1/nodes?limit=1").data)
    cluster.expire_history()
    resp = urllib3.request("GET", cluster.url + "/api/v1/nodes?limit=1&continue=" + first["metadata"]["continue"])
    recorded = load("list-continue-expired-410.json")["response"]["body"]
    got = json.loads(resp.data)
    assert resp.status == 410
    assert list(got) == list(recorded)
    assert {k: v for k, v in got.items() if k != "metadata"} == {k: v for k, v in recorded.items() if k != "metadata"}
    assert list(got["metadata"]) == ["continue"]
    # that token continues (inconsistently) from the current state, as on the apiserver
    rest = json.loads(urllib3.request("GET", cluster.url + "/api/v1/nodes?limit=1&continue="
                                      + got["metadata"]["continue"]).data)
    assert [i["metadata"]["name"] for i in rest["items"]] == ["gpu-node-2"]


def test_watch_from_expired_rv_is_one_error_event(cluster):
    cluster.expire_history()
    recorded = load("watch-expired-410.json")["response"]
    resp = replay(cluster, "watch-expired-410.json")
    assert resp.status == 200 and resp.headers.get("Transfer-Encoding") == "chunked"
    lines = resp.data.decode().splitlines()
    assert len(lines) == 1
    got, want = json.loads(lines[0]), recorded["events"][0]
    assert list(got) == list(want) == ["type", "object"]
    assert list(got["object"]) == list(want["object"])
    assert {k: v for k, v in got["object"].items() if k != "message"} == \
        {k: v for k, v in want["object"].items() if k != "message"}
    assert got["object"]["message"] == f"too old resource version: 1 ({cluster.resource_version})"


def test_watch_events_and_bookmark_shapes(cluster):
    rv = cluster.resource_version
    pool = urllib3.PoolManager()
    resp = pool.request("GET", f"{cluster.url}/api/v1/nodes?allowWatchBookmarks=true&resourceVersion={rv}"
                        "&timeoutSeconds=1&watch=true", preload_content=False)
    cluster.update_node("gpu-node-1", {"metadata": {"annotations": {"example.com/gpu-share": "watch-test"}}})
    cluster.add_node({"metadata": {"name": "gpu-node-3", "labels": {"fake-node": "true"}}})
    cluster.delete_node("gpu-node-3")
    events = [json.loads(line) for line in resp.read().decode().splitlines()]
    resp.release_conn()
    recorded = stream_events("nodes-watch-stream.jsonl")
    # the recording also labels gpu-node-3 between its ADDED and DELETED (one more MODIFIED)
    assert [e["type"] for e in recorded] == ["MODIFIED", "ADDED", "MODIFIED", "DELETED", "BOOKMARK"]
    assert [e["type"] for e in events] == ["MODIFIED", "ADDED", "DELETED", "BOOKMARK"]
    for got in events:
        assert list(got) == ["type", "object"]
        assert list(got["object"])[:3] == ["kind", "apiVersion", "metadata"]
    deleted = events[2]["object"]
    assert deleted["metadata"]["resourceVersion"] == cluster.resource_version  # DELETED carries the new rv
    want_bookmark = recorded[-1]["object"]
    got_bookmark = events[-1]["object"]
    assert got_bookmark["metadata"] == {"resourceVersion": cluster.resource_version}
    assert {k: v for k, v in got_bookmark.items() if k != "metadata"} == \
        {k: v for k, v in want_bookmark.items() if k != "metadata"}


def test_watch_without_rv_sends_synthetic_added_then_initial_end_bookmark(cluster):
    resp = urllib3.request("GET", f"{cluster.url}/api/v1/nodes?allowWatchBookmarks=true&timeoutSeconds=1"
                           "&watch=true")
    got = [json.loads(line) for line in resp.data.decode().splitlines()]
    recorded = stream_events("nodes-watch-norv-bookmarks-stream.jsonl")
    assert [e["type"] for e in got[:3]] == [e["type"] for e in recorded] == ["ADDED", "ADDED", "BOOKMARK"]
    assert got[0]["object"]["metadata"]["resourceVersion"] != cluster.resource_version  # objects keep their rv
    assert got[2]["object"]["metadata"]["annotations"] == recorded[2]["object"]["metadata"]["annotations"]
    assert {k: v for k, v in got[2]["object"].items() if k != "metadata"} == \
        {k: v for k, v in recorded[2]["object"].items() if k != "metadata"}


def test_pod_bookmark_shape(cluster):
    rv = cluster.resource_version
    resp = urllib3.request("GET", f"{cluster.url}/api/v1/pods?allowWatchBookmarks=true&resourceVersion={rv}"
                           "&timeoutSeconds=1&watch=true")
    (bookmark,) = [json.loads(line) for line in resp.data.decode().splitlines()]
    recorded = stream_events("pods-watch-stream.jsonl")[-1]
    assert bookmark["type"] == "BOOKMARK"
    assert {k: v for k, v in bookmark["object"].items() if k != "metadata"} == \
        {k: v for k, v in recorded["object"].items() if k != "metadata"}


def test_fake_serves_recorded_objects_unchanged(cluster):
    recorded = load("node-get.json")["response"]["body"]
    got = json.loads(urllib3.request("GET", cluster.url + "/api/v1/nodes/gpu-node-1").data)
    assert list(got) == list(recorded)
    assert got["status"] == recorded["status"]
    assert got["metadata"]["managedFields"] == recorded["metadata"]["managedFields"]
    assert got["metadata"]["uid"] == recorded["metadata"]["uid"]
