"""Merge patches of node and pod metadata through the official client against the fake apiserver."""

from __future__ import annotations

import pytest

from gputopo.kube import (
    Conflict,
    Invalid,
    KubeArgumentError,
    NotFound,
    get_node,
    patch_node_metadata,
    patch_pod_annotations,
)
from tests.helpers.kube import k8s_node, k8s_pod


def test_merge_patch_sets_and_removes_keys(fake, api):
    fake.add_node(k8s_node("n", labels={"old": "1"}, annotations={"keep": "k", "drop": "d"}))
    before = get_node(api, "n")["metadata"]["resourceVersion"]
    got = patch_node_metadata(api, "n", annotations={"gpu-topology.io/state": '{"v":1}', "drop": None},
                              labels={"gpu-topology.io/fabric": "nvswitch", "old": None})
    meta = got["metadata"]
    assert meta["annotations"] == {"keep": "k", "gpu-topology.io/state": '{"v":1}'}
    assert meta["labels"] == {"kubernetes.io/hostname": "n", "gpu-topology.io/fabric": "nvswitch"}
    assert int(meta["resourceVersion"]) > int(before)
    assert fake.node("n")["metadata"] == meta
    assert got["status"]["allocatable"]["nvidia.com/gpu"] == "8"  # the reply is the whole object


def test_patch_uses_merge_patch_content_type(fake, api):
    fake.add_node(k8s_node("n"))
    # the fake answers 415 for anything but the three patch types; merge patch semantics: null deletes
    patch_node_metadata(api, "n", annotations={"a": "1"})
    patch_node_metadata(api, "n", annotations={"a": None})
    assert "a" not in fake.node("n")["metadata"].get("annotations", {})
    assert [(r.method, r.path) for r in fake.requests] == [("PATCH", "/api/v1/nodes/n")] * 2


def test_noop_patch_keeps_resource_version(fake, api):
    fake.add_node(k8s_node("n", annotations={"a": "1"}))
    rv = fake.node("n")["metadata"]["resourceVersion"]
    got = patch_node_metadata(api, "n", annotations={"a": "1"})
    assert got["metadata"]["resourceVersion"] == rv


def test_stale_resource_version_is_conflict(fake, api):
    fake.add_node(k8s_node("n"))
    rv = fake.node("n")["metadata"]["resourceVersion"]
    fake.update_node("n", {"metadata": {"annotations": {"other": "writer"}}})
    with pytest.raises(Conflict) as exc:
        patch_node_metadata(api, "n", annotations={"a": "1"}, resource_version=rv)
    assert "the object has been modified" in exc.value.message
    current = fake.node("n")["metadata"]["resourceVersion"]
    patch_node_metadata(api, "n", annotations={"a": "1"}, resource_version=current)
    assert fake.node("n")["metadata"]["annotations"]["a"] == "1"


def test_invalid_label_value_is_invalid(fake, api):
    fake.add_node(k8s_node("n"))
    with pytest.raises(Invalid) as exc:
        patch_node_metadata(api, "n", labels={"example.com/bad": "not a valid value!"})
    assert exc.value.status == 422
    assert exc.value.body["details"]["causes"][0]["field"] == "metadata.labels"
    assert "example.com/bad" not in fake.node("n")["metadata"]["labels"]


def test_patch_missing_objects_is_not_found(fake, api):
    with pytest.raises(NotFound):
        patch_node_metadata(api, "nope", annotations={"a": "b"})
    with pytest.raises(NotFound):
        patch_pod_annotations(api, "default", "nope", {"a": "b"})


def test_patch_pod_annotations(fake, api):
    fake.add_pod(k8s_pod("p", labels={"app": "x"}))
    got = patch_pod_annotations(api, "default", "p", {"gpu-topology.io/plan": "{}"})
    assert got["metadata"]["annotations"] == {"gpu-topology.io/plan": "{}"}
    got = patch_pod_annotations(api, "default", "p", {"gpu-topology.io/plan": None})
    assert got["metadata"].get("annotations", {}) == {}
    assert got["metadata"]["labels"] == {"app": "x"}


@pytest.mark.parametrize("bad", [{"a": 1}, {"": "x"}, ["a"], {"a": ["x"]}])
def test_bad_values_are_refused_locally(fake, api, bad):
    with pytest.raises(KubeArgumentError):
        patch_node_metadata(api, "n", annotations=bad)
    assert fake.requests == []
