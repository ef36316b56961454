"""Fixtures: a running FakeKubeApi and an official-client ApiClient pointed at it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from tests.conftest import SHARED

RECORDINGS = SHARED / "recordings" / "kube-apiserver"


def node(name: str, labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> dict:
    meta: dict[str, Any] = {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}}
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta, "status": {"capacity": {"nvidia.com/gpu": "8"}, "allocatable": {"nvidia.com/gpu": "8"}}}


def pod(name: str, namespace: str = "default", node_name: str | None = None, labels: dict[str, str] | None = None,
        gpus: int = 1) -> dict:
    spec: dict[str, Any] = {
        "schedulerName": "gpu-share-scheduler",
        "containers": [{"name": "main", "image": "busybox",
                        "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}],
    }
    if node_name:
        spec["nodeName"] = node_name
    return {"metadata": {"name": name, "namespace": namespace, "labels": labels or {}}, "spec": spec}


class Events:
    """Thread-safe recorder of watcher callbacks with an event-driven wait (timeouts only bound failures)."""

    def __init__(self) -> None:
        self.items: list[tuple[str, dict]] = []
        self._cond = threading.Condition()

    def __call__(self, event_type: str, obj: dict) -> None:
        with self._cond:
            self.items.append((event_type, obj))
            self._cond.notify_all()

    def wait_for(self, predicate: Callable[[list[tuple[str, dict]]], bool], timeout: float = 10.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: predicate(self.items), timeout)

    def names(self, event_type: str) -> list[str]:
        with self._cond:
            return [o["metadata"].get("name", "") for t, o in self.items if t == event_type]

    def snapshots(self) -> list[dict]:
        with self._cond:
            return [o for t, o in self.items if t == "SYNC"]

    def has(self, event_type: str, name: str) -> Callable[[list[tuple[str, dict]]], bool]:
        return lambda items: any(t == event_type and o["metadata"].get("name") == name for t, o in items)


@pytest.fixture(autouse=True)
def _no_leaked_threads(no_leaked_threads: None) -> None:
    """Every server, watcher and worker thread a test here starts must be gone when it ends (tests/conftest.py)."""
