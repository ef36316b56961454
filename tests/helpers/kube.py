"""Kubernetes objects for the fake apiserver (tests/fakes/kubeapi), built the way the cluster holds them, and a
kubeconfig that points the official client (or a binary) at it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from gputopo.core import Topology, topology_to_json

if TYPE_CHECKING:
    from tests.fakes.kubeapi import FakeKubeApi

# The wire keys spelled out, not taken from gputopo.contract: a test that reads them checks the contract too.
PREFIX = "gpu-topology.io"
GPU = "nvidia.com/gpu"


def state_json(used: Sequence[str] = (), unhealthy: Sequence[str] = (), generation: int = 1) -> str:
    """The plugin's state annotation: the GPU ids used and unhealthy, at `generation`."""
    return json.dumps({"v": 1, "gen": generation, "used": sorted(used), "unhealthy": sorted(unhealthy)})


def node_annotations(t: Topology, used: Sequence[str] = (), unhealthy: Sequence[str] = (),
                     generation: int = 1) -> dict[str, str]:
    """What the plugin publishes on its Node: the topology and the state."""
    return {f"{PREFIX}/topology": topology_to_json(t), f"{PREFIX}/state": state_json(used, unhealthy, generation)}


def k8s_node(name: str, t: Topology | None = None, used: Sequence[int] = (), unhealthy: Sequence[int] = (),
             annotations: dict[str, str] | None = None, *, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A GPU Node: the hostname label (plus `labels`), nvidia.com/gpu capacity and allocatable (the topology's size,
    else 8); with a topology, the plugin's annotations, `used` and `unhealthy` given as indices into its GPUs.
    Without any annotation the Node has no annotations map at all, as a fresh one."""
    ann = node_annotations(t, [t.gpus[i].id for i in used], [t.gpus[i].id for i in unhealthy]) if t else {}
    ann.update(annotations or {})
    meta: dict[str, Any] = {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}}
    if ann:
        meta["annotations"] = ann
    gpus = str(t.size if t else 8)
    return {"metadata": meta, "status": {"capacity": {GPU: gpus}, "allocatable": {GPU: gpus}}}


def k8s_pod(name: str, gpus: int | str = 1, node: str | None = None, annotations: dict[str, str] | None = None, *,
            namespace: str = "default", labels: dict[str, str] | None = None, phase: str | None = None
            ) -> dict[str, Any]:
    """A Pod with one container asking for `gpus` nvidia.com/gpu (limits and requests; a quantity string is kept
    as written, 0 asks for none), bound to `node` when given."""
    container: dict[str, Any] = {"name": "main", "image": "registry.invalid/none:0"}
    if gpus not in (0, "0"):
        container["resources"] = {"limits": {GPU: str(gpus)}, "requests": {GPU: str(gpus)}}
    spec: dict[str, Any] = {"containers": [container]}
    if node:
        spec["nodeName"] = node
    pod: dict[str, Any] = {"metadata": {"name": name, "namespace": namespace, "labels": labels or {},
                                        "annotations": annotations or {}}, "spec": spec}
    if phase:
        pod["status"] = {"phase": phase}
    return pod


def write_kubeconfig(path: Path, server: str, token: str | None = None) -> Path:
    """A kubeconfig with one context: `server`, with a bearer `token` when given."""
    user = {"token": token} if token else {}
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}],
    }))
    return path


def set_state(fake: FakeKubeApi, name: str, used: Sequence[str], generation: int = 2) -> None:
    """Publish on the fake's Node what the plugin would after allocating `used` (GPU ids)."""
    fake.update_node(name, {"metadata": {"annotations": {f"{PREFIX}/state": state_json(used, (), generation)}}})
