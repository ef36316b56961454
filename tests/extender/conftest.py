"""Fixtures for the extender: real topologies, inventories, the app under a live uvicorn. The kube-scheduler bodies
are in tests/helpers/scheduler.py."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from extender.config import ExtenderConfig
from extender.http.app import create_app
from extender.service import Extender
from gputopo.core import Topology
from gputopo.discovery.loader import load_topology_file
from tests.extender.server import serve
from tests.helpers.paths import SHARED

TOPOLOGIES = SHARED / "topologies"
A100 = TOPOLOGIES / "hgx-a100-8gpu-epyc7763-pleiades.txt"  # 8 GPUs, one NVSwitch fabric
DGX1 = TOPOLOGIES / "dgx1-v100-ucxpy.txt"  # 8 GPUs, hybrid cube mesh NVLink
PCIE = TOPOLOGIES / "pcie-8x-rtx5090-2socket-sglang23020.txt"  # 8 GPUs, PCIe only, two sockets
H100X4 = TOPOLOGIES / "hgx-h100-4gpu-nv6-nccl1617.txt"  # 4 GPUs, all-to-all NV6


def topo(path: Path) -> Topology:
    return load_topology_file(path)


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
