"""The issue's interleaved creation, driven through filter, prioritize and bind over HTTP as kube-scheduler drives
them: 8 GPU nodes in 2 racks, 12 Kubeflow-labelled jobs with coscheduling PodGroups (2 workers x 1 GPU, 4 x 2,
2 x 4, four of each), workers created round-robin across the jobs as concurrent job controllers create them and
scheduled in creation order.

Measured behind a real kube-scheduler with per-pod placement (issue 12): no job landed on one node, and 4 jobs were
left with 3 of 4 workers bound holding 24 GPUs. With job plans every job that fitted on one node when its first
worker was scheduled lands on one node, and no job is left partly bound: a job is reserved whole or not at all.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from extender.service import Extender
from gputopo.core.bandwidth import HOST_PATH_GBPS
from gputopo.core.jobs import PodSlot, job_allreduce_gbps
from gputopo.core.locality import Locality
from sim.scheduler import SchedulerDriver
from tests.extender.jobs.conftest import DGX_A100, WAIT, cluster, k8s_node, kubeflow_pod, pod_group, rated
from tests.fakes.kubeapi.groups import FakeGroupsKubeApi

JOB_SHAPES = [(2, 1), (4, 2), (2, 4)]  # (workers, GPUs per worker)


def _free_gpus(ext: Extender) -> dict[str, int]:
    return {name: ext.cache.free_mask(e).bit_count() for name, e in ext.cache.nodes.items()}


def test_interleaved_jobs_land_whole_on_one_node_or_not_at_all(groups_fake: FakeGroupsKubeApi, groups_api) -> None:
    topo = rated(DGX_A100, 100.0)  # 12.5 GB/s NICs: one node's host path (25.8 GB/s) is faster than the network
    names = [f"n{i}" for i in range(8)]
    for i, name in enumerate(names):
        groups_fake.add_node(k8s_node(name, topo, rack=f"r{i // 4}"))
    jobs = {f"train-{j:02d}": JOB_SHAPES[j % 3] for j in range(12)}
    for job, (workers, _) in jobs.items():
        groups_fake.add_group(pod_group(job, workers))
    pods = []
    for index in range(4):  # round-robin: worker 0 of every job, then worker 1 of every job, ...
        for job, (workers, gpus) in jobs.items():
            if index < workers:
                pods.append((job, groups_fake.add_pod(kubeflow_pod(job, index, gpus))))

    with cluster(groups_api) as (ext, client):
        assert ext.cache.wait_for(lambda: len(ext.cache.groups.sizes) == 12, WAIT)
        driver = SchedulerDriver(str(client.base_url), seed=7)
        try:
            fitted: dict[str, bool] = {}
            bound: dict[str, list[tuple[str, str]]] = defaultdict(list)  # job -> (pod uid, node)
            refused: dict[str, str] = {}
            for job, pod in pods:
                workers, gpus = jobs[job]
                if job not in fitted:
                    fitted[job] = max(_free_gpus(ext).values()) >= workers * gpus
                decision = driver.schedule(pod, names)
                if decision.node is not None:
                    bound[job].append((pod["metadata"]["uid"], decision.node))
                else:
                    refused[job] = decision.reason
        finally:
            driver.close()

        for job, (workers, _) in jobs.items():
            placed = bound.get(job, [])
            assert len(placed) in (0, workers), f"{job} is partly bound: {placed}; refused: {refused.get(job)}"
            if fitted[job]:
                assert placed, f"{job} fitted on one node when its first worker came, yet: {refused.get(job)}"
                assert len({node for _, node in placed}) == 1, f"{job} spread over {placed}"
            else:
                assert not placed and job in refused
                assert f"job ml/{job}: needs {workers} more workers" in refused[job], refused[job]

        # the plans as bound: each job's pods on their planned GPUs, no GPU given twice, and the estimate of a
        # job on one node is the host path between its pods (each pod sees only its own GPUs)
        taken: dict[str, set[str]] = defaultdict(set)
        complete = 0
        for job, placed in bound.items():
            slots = []
            for uid, node in placed:
                plan = ext.cache.reservations.get(uid, node).plan
                assert plan is not None and plan.node == node and len(plan.ids) == jobs[job][1]
                assert not taken[node] & plan.ids, f"GPUs {taken[node] & plan.ids} on {node} given twice"
                taken[node] |= plan.ids
                entry = ext.cache.nodes[node]
                slots.append(PodSlot(node, entry.topo, tuple(sorted(entry.index[i] for i in plan.ids)), entry.place))
            estimate = job_allreduce_gbps(slots, Locality())
            assert estimate.gbps == pytest.approx(HOST_PATH_GBPS)
            complete += 1
        assert complete == 11  # 72 GPUs asked of 64: the last 8-GPU job found no room, and took none
        assert ext.jobs.open_slots() == 0  # every slot of every plan was taken by its pods
