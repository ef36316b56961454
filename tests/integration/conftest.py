"""One real control plane for the whole real-control-plane tier (tests/helpers/controlplane.py): etcd,
kube-apiserver and kube-controller-manager start once per session; each module borrows it through `tidied`, which
deletes what the module made, and starts its own kube-schedulers and extenders."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.controlplane import ControlPlane, skip_reason


@pytest.fixture(scope="session")
def real_control_plane() -> Iterator[ControlPlane]:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    with ControlPlane(controller_manager=True) as cp:
        yield cp
