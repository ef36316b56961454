"""Fixtures: the kubelet's PodResources service on a short socket path (as `kubelet` here, in place of the
simulator of tests/conftest.py), and the GPU Node the publisher writes to."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.kubelet_podresources import PodResourcesServer
from tests.helpers.kube import k8s_node
from tests.helpers.paths import short_dir

NODE = "gpu-node-1"


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with short_dir("podres-") as path:
        yield path


@pytest.fixture
def kubelet(sock_dir: Path) -> Iterator[PodResourcesServer]:
    with PodResourcesServer(str(sock_dir / "kubelet.sock")) as server:
        yield server


def node_object(name: str = NODE) -> dict:
    """The Node with a label and an annotation of someone else's, which the publisher must keep."""
    return k8s_node(name, labels={"team": "ml"}, annotations={"example.com/keep": "me"})
