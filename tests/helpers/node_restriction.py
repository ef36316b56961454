"""A real control plane whose kube-apiserver also runs the NodeRestriction admission plugin (not among its
defaults, nor in tests/helpers/controlplane.py's), so a kubelet's own writes to its Node are judged as on a real
cluster: what a kubelet may label itself with (`--node-labels`) is the apiserver's verdict, not ours.

A kubelet is impersonated (user system:node:<name>, group system:nodes) by the admin's client, which may: the Node
authorizer and NodeRestriction then treat the request as that kubelet's."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import httpx

import tests.helpers.controlplane as controlplane
from tests.helpers.controlplane import ControlPlane

ADMISSION_FLAG = "--enable-admission-plugins=NodeRestriction"


@contextmanager
def node_restricted_control_plane() -> Iterator[ControlPlane]:
    original = controlplane.start_process

    def start(name: str, argv: Any, *args: Any, **kwargs: Any) -> Any:
        if name == "kube-apiserver":
            argv = [*argv, ADMISSION_FLAG]
        return original(name, argv, *args, **kwargs)

    controlplane.start_process = start
    try:
        with ControlPlane() as cp:
            yield cp
    finally:
        controlplane.start_process = original


def as_kubelet(node: str) -> dict[str, str]:
    """Headers that make the admin's request the kubelet's of `node`."""
    return {"Impersonate-User": f"system:node:{node}", "Impersonate-Group": "system:nodes"}


def register_as_kubelet(cp: ControlPlane, node: str, labels: Mapping[str, str], *,
                        dry_run: bool = False) -> httpx.Response:
    """The kubelet's registration of its Node with `--node-labels` (its create, as the kubelet sends it)."""
    return cp.api().post("/api/v1/nodes", params={"dryRun": "All"} if dry_run else None,
                         json={"metadata": {"name": node, "labels": dict(labels)}}, headers=as_kubelet(node))
