"""Job plans in the running extender: GPU nodes in racks published on the in-process kube-apiserver (with the gang
schedulers' group kinds served), Kubeflow-labelled pods, PodGroups, and the extender in cluster mode on uvicorn."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import kubernetes.client
import pytest

from extender.config import ExtenderConfig
from extender.service import Extender
from extender.state.reservations import JOB
from gputopo.core import Topology
from gputopo.core.topology import Nic
from gputopo.discovery.loader import load_topology_file
from gputopo.kube import make_api_client
from tests.conftest import SHARED
from tests.extender.conftest import running
from tests.fakes.kubeapi.groups import FakeGroupsKubeApi
from tests.helpers.kube import k8s_node as node

PREFIX = "gpu-topology.io"
RACK = "network.topology.nvidia.com/leaf"  # the first key of the default locality's rack level
DGX_A100 = SHARED / "topologies" / "dgx-a100-8gpu-10nic-1mcprddgx05.txt"  # NVSwitch, 10 NICs (8 on GPU switches)
SYNC_OPTIONS = {"watch_timeout_s": 60, "backoff_initial_s": 0.02, "backoff_max_s": 0.1}
WAIT = 20.0  # liveness bound of waits on a loaded machine, never a performance figure


def rated(path: Any, gbit: float) -> Topology:
    """A shared fixture with its NICs given a line rate (the text has none) and marked RDMA."""
    t = load_topology_file(path)
    nics = [Nic(n.name, n.gpu_links, True, gbit) for n in t.nics]
    return Topology.build(t.gpus, t.links, nics, t.pcie_generation, t.socket_link_gbps)


def k8s_node(name: str, t: Topology, rack: str | None = None, used: list[int] | None = None) -> dict[str, Any]:
    """The shared GPU Node (tests.helpers.kube), labelled with its rack."""
    return node(name, t, used or (), labels={RACK: rack} if rack else None)


def kubeflow_pod(job: str, index: int, gpus: int, *, namespace: str = "ml", pod_group: bool = True,
                 labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A PyTorchJob worker as the training operator creates it (with the coscheduling PodGroup label its gang
    scheduling adds when `pod_group`)."""
    all_labels = {"training.kubeflow.org/job-name": job, "training.kubeflow.org/operator-name": "pytorchjob-controller",
                  "training.kubeflow.org/replica-type": "worker", "training.kubeflow.org/replica-index": str(index),
                  **({"scheduling.x-k8s.io/pod-group": job} if pod_group else {}), **(labels or {})}
    return {
        "metadata": {"name": f"{job}-worker-{index}", "namespace": namespace, "labels": all_labels,
                     "annotations": annotations or {}},
        "spec": {"schedulerName": "gpu-topology-scheduler", "restartPolicy": "OnFailure", "priority": 0,
                 "containers": [{"name": "pytorch", "image": "registry.invalid/trainer:1", "resources": {
                     "limits": {"nvidia.com/gpu": str(gpus)}, "requests": {"nvidia.com/gpu": str(gpus)}}}]},
    }


def pod_group(name: str, min_member: Any, namespace: str = "ml") -> dict[str, Any]:
    """A scheduler-plugins (coscheduling) PodGroup."""
    return {"apiVersion": "scheduling.x-k8s.io/v1alpha1", "kind": "PodGroup",
            "metadata": {"name": name, "namespace": namespace}, "spec": {"minMember": min_member}}


@pytest.fixture
def groups_fake() -> Iterator[FakeGroupsKubeApi]:
    with FakeGroupsKubeApi() as server:
        yield server


@pytest.fixture
def groups_api(groups_fake: FakeGroupsKubeApi) -> Iterator[kubernetes.client.ApiClient]:
    client = make_api_client(host=groups_fake.url, timeout_s=5.0)
    yield client
    client.close()


@contextmanager
def cluster(api: kubernetes.client.ApiClient, *, clock: Callable[[], float] | None = None,
            group_retry_s: float = 0.2, **config: Any) -> Iterator[tuple[Extender, httpx.Client]]:
    """The extender in cluster mode on uvicorn, its node and pod caches synced."""
    kwargs: dict[str, Any] = {"sync_options": {**SYNC_OPTIONS, "group_retry_s": group_retry_s}}
    if clock is not None:
        kwargs.update(clock=clock, expiry_interval_s=3600)
    ext = Extender.cluster(api, ExtenderConfig(**config), **kwargs)
    with running(ext) as client:
        assert ext.sync is not None and ext.sync.wait_synced(WAIT)
        yield ext, client


@pytest.fixture(autouse=True)
def _no_leaked_threads(no_leaked_threads: None) -> None:
    """Every server, watcher and worker thread a test here starts must be gone when it ends (tests/conftest.py)."""


def job_slots(ext: Extender) -> dict[str, int]:
    """Node -> GPUs held by job slots."""
    out: dict[str, int] = {}
    for r in ext.reservations.all():
        if r.source == JOB:
            out[r.node] = out.get(r.node, 0) + len(r.ids)
    return out
