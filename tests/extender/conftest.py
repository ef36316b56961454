"""Fixtures for the extender: real topologies, the recorded kube-scheduler bodies, a live uvicorn, FakeKubeApi."""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from extender.app import create_app
from extender.config import ExtenderConfig
from extender.service import Extender
from gputopo.core import Topology, topology_to_json
from gputopo.discovery.loader import load_topology_file
from tests.conftest import SHARED
from tests.extender.server import serve

RECORDED = SHARED / "recordings" / "kube-scheduler"
TOPOLOGIES = SHARED / "topologies"
A100 = TOPOLOGIES / "hgx-a100-8gpu-epyc7763-pleiades.txt"  # 8 GPUs, one NVSwitch fabric
DGX1 = TOPOLOGIES / "dgx1-v100-ucxpy.txt"  # 8 GPUs, hybrid cube mesh NVLink
PCIE = TOPOLOGIES / "pcie-8x-rtx5090-2socket-sglang23020.txt"  # 8 GPUs, PCIe only, two sockets
H100X4 = TOPOLOGIES / "hgx-h100-4gpu-nv6-nccl1617.txt"  # 4 GPUs, all-to-all NV6
PREFIX = "gpu-topology.io"


def recorded(name: str) -> Any:
    return json.loads((RECORDED / name).read_text())


def topo(path: Path) -> Topology:
    return load_topology_file(path)


def pod_json(name: str = "gpu-pod", gpus: int = 1, *, uid: str | None = None, namespace: str = "default",
             annotations: dict[str, str] | None = None, containers: list[dict[str, Any]] | None = None,
             init_containers: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The Pod kube-scheduler sent in the recording, with name, uid, GPU count (or containers) substituted."""
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
    c["resources"] = {"limits": {"nvidia.com/gpu": str(n)}, "requests": {"nvidia.com/gpu": str(n)}} if n else {}
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
    item["status"]["allocatable"]["nvidia.com/gpu"] = str(gpus)
    item["status"]["capacity"]["nvidia.com/gpu"] = str(gpus)
    return item


def list_args(pod: dict[str, Any], items: list[dict[str, Any]]) -> dict[str, Any]:
    """Full-NodeList body: the recording with Pod and Nodes.items substituted (NodeNames stays null)."""
    body = recorded("filter.json")
    body["Pod"] = pod
    body["Nodes"]["items"] = items
    assert body["NodeNames"] is None
    return body


def bind_body(pod: dict[str, Any], node: str) -> dict[str, Any]:
    body = recorded("bind-nodecache.json")
    body.update(PodName=pod["metadata"]["name"], PodNamespace=pod["metadata"]["namespace"],
                PodUID=pod["metadata"]["uid"], Node=node)
    return body


def node_annotations(t: Topology, used: list[str] | None = None, unhealthy: list[str] | None = None,
                     generation: int = 1) -> dict[str, str]:
    state = {"v": 1, "gen": generation, "used": sorted(used or []), "unhealthy": sorted(unhealthy or [])}
    return {f"{PREFIX}/topology": topology_to_json(t), f"{PREFIX}/state": json.dumps(state)}


def write_inventory(path: Path, nodes: list[dict[str, Any]]) -> Path:
    """nodes: dicts of the inventory format; `topology` may be a Path."""
    out = []
    for n in nodes:
        n = dict(n)
        if isinstance(n.get("topology"), Path):
            n["topology"] = str(n["topology"])
        out.append(n)
    path.write_text(yaml.safe_dump({"nodes": out}))
    return path


@contextmanager
def running(ext: Extender, **server: Any) -> Iterator[httpx.Client]:
    """The extender's app under uvicorn on 127.0.0.1 and an HTTP client for it."""
    with serve(create_app(ext), **server) as url, httpx.Client(base_url=url, timeout=30) as client:
        yield client


@pytest.fixture
def standalone(tmp_path: Path) -> Callable[..., Any]:
    """standalone(nodes, **config) -> context manager yielding (extender, client)."""

    @contextmanager
    def make(nodes: list[dict[str, Any]], **config: Any) -> Iterator[tuple[Extender, httpx.Client]]:
        inv = write_inventory(tmp_path / f"inventory-{uuid.uuid4().hex[:6]}.yaml", nodes)
        ext = Extender.standalone(inv, ExtenderConfig(**config))
        with running(ext) as client:
            yield ext, client

    return make


@pytest.fixture(autouse=True)
def _no_leaked_threads(no_leaked_threads: None) -> None:
    """Every server, watcher and worker thread a test here starts must be gone when it ends (tests/conftest.py)."""
