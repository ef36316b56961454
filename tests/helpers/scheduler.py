"""The bodies kube-scheduler sends the extender, from the recordings in fixtures/recordings/kube-scheduler with
the test's pod, nodes and names substituted, so every test speaks the scheduler's exact JSON."""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any

from tests.helpers.kube import GPU
from tests.helpers.paths import SHARED

RECORDED = SHARED / "recordings" / "kube-scheduler"


def recorded(name: str) -> Any:
    """A recorded exchange, fresh each call (callers edit it)."""
    return json.loads((RECORDED / name).read_text())


def pod_json(name: str = "gpu-pod", gpus: int = 1, *, uid: str | None = None, namespace: str = "default",
             annotations: dict[str, str] | None = None, containers: list[dict[str, Any]] | None = None,
             init_containers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The Pod kube-scheduler sent in the recording, with name, uid, GPU count (or containers) substituted.
    `containers` and `init_containers` are dicts {"name", "gpus", "sidecar"}."""
    pod = copy.deepcopy(recorded("filter-nodecache.json")["Pod"])
    pod["metadata"]["name"] = name
    pod["metadata"]["namespace"] = namespace
    pod["metadata"]["uid"] = uid or str(uuid.uuid4())
    if annotations:
        pod["metadata"]["annotations"] = dict(annotations)
    template = pod["spec"]["containers"][0]
    if containers is None:
        containers = [{"name": "main", "gpus": gpus}]
    pod["spec"]["containers"] = [_container(template, c) for c in containers]
    if init_containers:
        pod["spec"]["initContainers"] = [_container(template, c) for c in init_containers]
    return pod


def _container(template: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    c = copy.deepcopy(template)
    c["name"] = spec["name"]
    n = spec.get("gpus", 0)
    c["resources"] = {"limits": {GPU: str(n)}, "requests": {GPU: str(n)}} if n else {}
    if spec.get("sidecar"):
        c["restartPolicy"] = "Always"
    return c


def cache_args(pod: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """nodeCacheCapable body: the recording with Pod and NodeNames substituted (Nodes stays an explicit null)."""
    body = recorded("filter-nodecache.json")
    body["Pod"] = pod
    body["NodeNames"] = list(names)
    assert body["Nodes"] is None
    return body


def node_item(name: str, annotations: dict[str, str] | None = None, gpus: int = 8) -> dict[str, Any]:
    """A Node exactly as the recorded full-NodeList body carries it, renamed, with our annotations."""
    item = copy.deepcopy(recorded("filter.json")["Nodes"]["items"][1])
    item["metadata"]["name"] = item["metadata"]["labels"]["kubernetes.io/hostname"] = name
    item["metadata"]["uid"] = str(uuid.uuid4())
    if annotations:
        item["metadata"]["annotations"] = dict(annotations)
    item["status"]["allocatable"][GPU] = str(gpus)
    item["status"]["capacity"][GPU] = str(gpus)
    return item


def list_args(pod: dict[str, Any], items: list[dict[str, Any]]) -> dict[str, Any]:
    """Full-NodeList body: the recording with Pod and Nodes.items substituted (NodeNames stays null)."""
    body = recorded("filter.json")
    body["Pod"] = pod
    body["Nodes"]["items"] = items
    assert body["NodeNames"] is None
    return body


def bind_body(pod: dict[str, Any], node: str) -> dict[str, Any]:
    """The recorded ExtenderBindingArgs for `pod` on `node`."""
    body = recorded("bind-nodecache.json")
    body.update(PodName=pod["metadata"]["name"], PodNamespace=pod["metadata"]["namespace"],
                PodUID=pod["metadata"]["uid"], Node=node)
    return body
