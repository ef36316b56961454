"""A job pod's own floors (require-nvlink, min-allreduce-gbps) hold for every pod of its job's plan: filter and the
plan reserved at the first pod keep off nodes and GPU sets whose rings miss them, and say so when no node has room."""

from __future__ import annotations

from typing import Any

import httpx

from gputopo.discovery.loader import load_topology_file
from tests.conftest import SHARED
from tests.extender.jobs.conftest import (
    DGX_A100,
    PREFIX,
    WAIT,
    cluster,
    job_slots,
    k8s_node,
    kubeflow_pod,
    pod_group,
    rated,
)
from tests.fakes.kubeapi.groups import FakeGroupsKubeApi
from tests.helpers.scheduler import cache_args

RTX5090 = SHARED / "topologies" / "pcie-8x-rtx5090-2socket-sglang23020.txt"  # PCIe only, two sockets
NVLINK = {f"{PREFIX}/require-nvlink": "true"}


def filter_(client: httpx.Client, pod: dict[str, Any], names: list[str]) -> dict[str, Any]:
    r = client.post("/filter", json=cache_args(pod, names))
    assert r.status_code == 200
    return r.json()


def test_a_require_nvlink_job_is_planned_on_nvlink_gpus_only(groups_fake: FakeGroupsKubeApi, groups_api) -> None:
    """Without the annotation the job's best plan is one whole PCIe server (its host path beats the network
    between two NVSwitch nodes with one pod's room each); with it, the two NVSwitch nodes."""
    pcie = load_topology_file(RTX5090)
    nv = rated(DGX_A100, 100.0)
    names = [f"pcie-{i}" for i in range(3)] + ["nv-1", "nv-2"]
    for name in names[:3]:
        groups_fake.add_node(k8s_node(name, pcie, rack="r1"))
    for name in names[3:]:
        groups_fake.add_node(k8s_node(name, nv, rack="r1", used=list(range(6))))
    for job, extra in (("train-nv", NVLINK), ("train-any", {})):
        groups_fake.add_group(pod_group(job, 2))
        for i in range(2):
            groups_fake.add_pod(kubeflow_pod(job, i, 2, annotations=extra))
    with cluster(groups_api) as (ext, client):
        assert ext.cache.wait_for(lambda: len(ext.cache.groups.sizes) == 2, WAIT)
        out = filter_(client, kubeflow_pod("train-any", 0, 2), names)
        assert len(out["NodeNames"]) == 1 and out["NodeNames"][0].startswith("pcie-")
        out = filter_(client, kubeflow_pod("train-nv", 0, 2, annotations=NVLINK), names)
        assert sorted(out["NodeNames"]) == ["nv-1", "nv-2"]
        slots = job_slots(ext)
        assert slots["nv-1"] == slots["nv-2"] == 2


def test_a_require_nvlink_job_without_room_names_the_floor(groups_fake: FakeGroupsKubeApi, groups_api) -> None:
    pcie = load_topology_file(RTX5090)
    names = [f"pcie-{i}" for i in range(3)]
    for name in names:
        groups_fake.add_node(k8s_node(name, pcie, rack="r1"))
    groups_fake.add_group(pod_group("train-pcie", 2))
    pods = [groups_fake.add_pod(kubeflow_pod("train-pcie", i, 2, annotations=NVLINK)) for i in range(2)]
    plain = [groups_fake.add_pod(kubeflow_pod("train-any", i, 2, pod_group=False)) for i in range(2)]
    with cluster(groups_api) as (ext, client):
        assert ext.cache.wait_for(lambda: ext.cache.groups.sizes, WAIT)
        out = filter_(client, pods[0], names)
        assert out["NodeNames"] == []
        reason = next(iter(set(out["FailedNodes"].values())))
        assert "whose rings meet require-nvlink" in reason and "room for 0" in reason
        assert job_slots(ext) == {}
        # the same job without the annotation is placed on the PCIe servers
        assert filter_(client, plain[0], names)["NodeNames"]
