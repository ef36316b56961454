"""Fixtures: a fake kubelet PodResources socket, a FakeKubeApi with one GPU node, the official client against it."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.kubelet_podresources import PodResourcesServer

NODE = "gpu-node-1"


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="podres-", dir="/tmp"))  # unix socket paths must stay short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(sock_dir: Path) -> Iterator[PodResourcesServer]:
    with PodResourcesServer(str(sock_dir / "kubelet.sock")) as server:
        yield server


def node_object(name: str = NODE) -> dict:
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "team": "ml"},
                     "annotations": {"example.com/keep": "me"}},
        "status": {"capacity": {"nvidia.com/gpu": "8"}, "allocatable": {"nvidia.com/gpu": "8"}},
    }

