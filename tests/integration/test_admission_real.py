"""The extender's plan and the kubelet's allocation, end to end through the real components: a real kube-apiserver and
kube-scheduler v1.36.2 with our extender, the plugin process on simulated GPU nodes, and sim.admission admitting the
bound pods as the kubelet does (listed in PodResources just before admission, containers allocated in order, pods of
one arrival by creation time). Every pod must get exactly the GPUs its plan names: the plugin ties a plan to the pod
being admitted, never to another pending pod whose plan happens to fit.

Skips, naming why, where the Kubernetes binaries (shared/kube beside the clone) or etcd are absent."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gputopo.contract import DEFAULT_KEYS, replica_parent
from gputopo.core import allreduce_gbps, best_subset
from gputopo.core.mig import H200_141GB
from gputopo.discovery.loader import load_topology_file
from tests.extender.jobs.conftest import kubeflow_pod
from tests.fixtures.mig_recordings import BALANCED_141
from tests.helpers.controlplane import ControlPlane, ExtenderProcess, Scheduler, extender_stanza, tidied
from tests.helpers.kube import k8s_pod
from tests.helpers.mig import mig_recording, write_recording
from tests.helpers.paths import SHARED
from tests.helpers.realnode import install_crd, plan_of, real_gpu_node

GPU = "nvidia.com/gpu"
MIG_1G = "nvidia.com/mig-1g.18gb"
MIG_NAMES = (MIG_1G, "nvidia.com/mig-2g.35gb", "nvidia.com/mig-3g.71gb")
DGX1 = SHARED / "topologies" / "dgx1-v100-ucxpy.txt"
WAIT = 90.0  # liveness bound of the waits, never a performance figure
# NVIDIA's time-slicing file as teams write it: every GPU as 4 replicas, still called nvidia.com/gpu.
TIME_SLICING = """version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(real_control_plane: ControlPlane) -> Iterator[tuple[ControlPlane, ExtenderProcess, Scheduler]]:
    with tidied(real_control_plane) as cp:
        # the operators' kinds, before the extender starts watching them (as a cluster has them installed)
        install_crd(cp, "kubeflow.org", "v1", "pytorchjobs", "PyTorchJob")
        install_crd(cp, "kubeflow.org", "v2beta1", "mpijobs", "MPIJob")
        ext = cp.start_extender()
        stanza = extender_stanza(ext.url)
        stanza["managedResources"] += [{"name": n, "ignoredByScheduler": False} for n in MIG_NAMES]
        yield cp, ext, cp.start_scheduler([stanza])


def _create(cp: ControlPlane, ns: str, name: str, gpus: int, resource: str = GPU) -> dict[str, Any]:
    pod = k8s_pod(name, gpus, namespace=ns)
    pod["spec"]["containers"][0]["resources"] = {"limits": {resource: str(gpus)}, "requests": {resource: str(gpus)}}
    return cp.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)  # type: ignore[no-any-return]


def _plan_matches_allocation(pods: list[dict[str, Any]], held: dict[str, list[str]]) -> list[str]:
    """Every pod's planned ids against what the kubelet allocated to it; the pods where they differ."""
    wrong = []
    for pod in pods:
        key = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}"
        plan = plan_of(pod)
        if plan is None:
            wrong.append(f"{key} was bound without a plan (not through the extender)")
            continue
        planned = sorted(i for ids in plan["containers"].values() for i in ids)
        if planned != sorted(held.get(key, [])):
            wrong.append(f"{key} on {pod['spec'].get('nodeName')}: planned {planned}, allocated {held.get(key)}")
    return wrong


def _wait_settled(cp: ControlPlane, ns: str, count: int, timeout: float = WAIT) -> list[dict[str, Any]]:
    """The namespace's pods once all `count` are past admission (Running or Failed)."""
    deadline = time.monotonic() + timeout
    pods: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        pods = cp.list_items(f"/api/v1/namespaces/{ns}/pods")
        if len(pods) == count and all((p.get("status") or {}).get("phase") in ("Running", "Failed") for p in pods):
            return pods
        time.sleep(0.2)
    phases = {p["metadata"]["name"]: (p.get("status") or {}).get("phase") for p in pods}
    raise AssertionError(f"not settled in {timeout} s: {phases}")


def test_time_sliced_pods_get_the_replicas_of_exactly_their_planned_gpus(
        cluster: tuple[ControlPlane, ExtenderProcess, Scheduler], tmp_path: Path) -> None:
    """12 two-replica pods on a time-sliced DGX-1 (4 replicas per GPU): 6 created one by one, then 6 at once.
    Admitted pods stay Pending for 2 s (image pulls), so their plans still fit later questions."""
    cp, _, _ = cluster
    ns = "slicing"
    cp.ensure_namespace(ns)
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "default").write_text(TIME_SLICING)
    args = ["--device-id-strategy", "index", "--sharing-config-dir", str(configs), "--sharing-poll-interval", "0.2"]
    with real_gpu_node(cp, "slice-dgx1", topology=DGX1, args=args, start_delay_s=2.0) as node:
        node.wait_published(GPU, 32, WAIT)
        for i in range(6):
            _create(cp, ns, f"c3-{i:03d}-2r", 2)
            _wait_settled(cp, ns, i + 1)
        for i in range(6, 12):
            _create(cp, ns, f"c3-{i:03d}-2r", 2)
        pods = _wait_settled(cp, ns, 12)
        held = node.admission.held(GPU)
        wrong = _plan_matches_allocation(pods, {k: sorted({replica_parent(r)[0] for r in v}) for k, v in held.items()})
        assert not wrong, f"plan != Allocate for {len(wrong)} of 12 pods: {wrong}\n{node.log_tail(3000)}"
        given = [r for v in held.values() for r in v]
        assert len(given) == len(set(given)) == 24, "a replica given twice"
        for key, replicas in held.items():
            assert len({replica_parent(r)[0] for r in replicas}) == 2, f"{key}: replicas not on distinct GPUs"


def test_whole_gpu_pods_of_every_size_get_exactly_their_plan_and_the_best_set(
        cluster: tuple[ControlPlane, ExtenderProcess, Scheduler]) -> None:
    """Pods of 8, 4, 3, 2 and 1 GPUs created one after the other on two DGX-1 nodes (hybrid cube mesh: the choice
    matters): each gets exactly its plan, and its plan is the best set of the GPUs its node had free."""
    cp, _, _ = cluster
    ns = "whole"
    cp.ensure_namespace(ns)
    topology = load_topology_file(DGX1)
    sizes = [8, 4, 3, 1]
    with real_gpu_node(cp, "whole-a", topology=DGX1, args=["--device-id-strategy", "index"], seed=1) as a, \
            real_gpu_node(cp, "whole-b", topology=DGX1, args=["--device-id-strategy", "index"], seed=2) as b:
        a.wait_published(GPU, 8, WAIT)
        b.wait_published(GPU, 8, WAIT)
        taken: dict[str, set[int]] = {"whole-a": set(), "whole-b": set()}
        for i, n in enumerate(sizes):
            _create(cp, ns, f"w-{i:02d}-{n}g", n)
            pods = _wait_settled(cp, ns, i + 1)
            pod = next(p for p in pods if p["metadata"]["name"] == f"w-{i:02d}-{n}g")
            node = pod["spec"]["nodeName"]
            held = {**a.admission.held(GPU), **b.admission.held(GPU)}
            assert not _plan_matches_allocation([pod], held), _plan_matches_allocation([pod], held)
            got = [int(x) for x in held[f"{ns}/{pod['metadata']['name']}"]]
            free = [g for g in range(8) if g not in taken[node]]
            best = best_subset(topology, free, n)
            assert allreduce_gbps(topology, got) == pytest.approx(allreduce_gbps(topology, best.gpus)), \
                f"{n} GPUs on {node}: got {got}, the best of {free} is {list(best.gpus)}"
            taken[node] |= set(got)
        ids = [i for node in (a, b) for v in node.admission.held(GPU).values() for i in v]
        assert len(ids) == sum(sizes)


def test_mig_and_whole_gpu_pods_on_one_node_get_exactly_their_plan(
        cluster: tuple[ControlPlane, ExtenderProcess, Scheduler], tmp_path: Path) -> None:
    """An H200 node under the mixed strategy (GPU 4 as seven 1g.18gb, GPU 5 balanced, six whole GPUs), replayed
    from a recording: 1g.18gb pods and whole-GPU pods created at once each get exactly the instances or GPUs
    their plan names."""
    cp, _, _ = cluster
    ns = "mig"
    cp.ensure_namespace(ns)
    all_1g = [("1g.18gb", s, (1,)) for s in range(7)]
    recording = write_recording(tmp_path / "rec.json", mig_recording(
        H200_141GB, [None, None, None, None, all_1g, list(BALANCED_141), None, None]))
    args = ["--mig-strategy", "mixed", "--mig-poll-interval", "0.2", "--sharing-poll-interval", "0.2"]
    with real_gpu_node(cp, "mig-h200", nvml_recording=recording, args=args) as node:
        node.wait_published(MIG_1G, 9, WAIT)
        node.wait_published(GPU, 6, WAIT)
        for i in range(5):
            _create(cp, ns, f"infer-{i}", 1, MIG_1G)
        for i in range(2):
            _create(cp, ns, f"train-{i}", 2)
        pods = _wait_settled(cp, ns, 7)
        held = {**node.admission.held(MIG_1G), **node.admission.held(GPU)}
        assert all(p["status"]["phase"] == "Running" for p in pods), [p["status"] for p in pods]
        assert not _plan_matches_allocation(pods, held), _plan_matches_allocation(pods, held)


def _job(cp: ControlPlane, ns: str, kind: str, name: str, specs: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """A PyTorchJob (kubeflow.org/v1) or MPIJob (v2beta1): role -> (replicas, GPUs per pod)."""
    version, plural, field = {"PyTorchJob": ("v1", "pytorchjobs", "pytorchReplicaSpecs"),
                              "MPIJob": ("v2beta1", "mpijobs", "mpiReplicaSpecs")}[kind]
    roles = {}
    for role, (n, g) in specs.items():
        container: dict[str, Any] = {"name": "main", "image": "registry.invalid/none:0"}
        if g:
            container["resources"] = {"limits": {GPU: str(g)}}
        roles[role] = {"replicas": n, "template": {"spec": {"containers": [container]}}}
    body = {"apiVersion": f"kubeflow.org/{version}", "kind": kind, "metadata": {"name": name, "namespace": ns},
            "spec": {field: roles}}
    return cp.request("POST", f"/apis/kubeflow.org/{version}/namespaces/{ns}/{plural}", body)  # type: ignore


def _operator_pod(cp: ControlPlane, job: dict[str, Any], role: str, index: int, gpus: int) -> None:
    """A pod as the training operator (PyTorchJob) or the MPI operator makes it: its labels and ownerReference."""
    kind, name, ns = job["kind"], job["metadata"]["name"], job["metadata"]["namespace"]
    labels = {"training.kubeflow.org/job-name": name, "training.kubeflow.org/replica-index": str(index)}
    if kind == "PyTorchJob":
        labels |= {"training.kubeflow.org/operator-name": "pytorchjob-controller",
                   "training.kubeflow.org/replica-type": role.lower()}
        if role == "Master":
            labels["training.kubeflow.org/job-role"] = "master"
    else:
        labels |= {"training.kubeflow.org/operator-name": "mpi-operator",
                   "training.kubeflow.org/job-role": role.lower()}
    pod = k8s_pod(f"{name}-{role.lower()}-{index}", gpus, namespace=ns, labels=labels)
    pod["metadata"]["ownerReferences"] = [{"apiVersion": job["apiVersion"], "kind": kind, "name": name,
                                           "uid": job["metadata"]["uid"], "controller": True,
                                           "blockOwnerDeletion": True}]
    cp.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)


def test_kubeflow_jobs_created_interleaved_each_land_whole_on_one_node(
        cluster: tuple[ControlPlane, ExtenderProcess, Scheduler]) -> None:
    """Two PyTorchJobs and an MPIJob (real kinds, pods with the operators' labels and ownerReferences), 8 GPUs each,
    their pods created interleaved, on three 8-GPU nodes: each job fits one node only if none is split, and every
    pod gets exactly its plan."""
    cp, _, _ = cluster
    ns = "jobs"
    cp.ensure_namespace(ns)
    a = _job(cp, ns, "PyTorchJob", "llm-a", {"Master": (1, 2), "Worker": (3, 2)})
    b = _job(cp, ns, "PyTorchJob", "llm-b", {"Worker": (4, 2)})
    c = _job(cp, ns, "MPIJob", "hpc-c", {"Launcher": (1, 0), "Worker": (2, 4)})
    order = [(a, "Master", 0, 2), (b, "Worker", 0, 2), (c, "Worker", 0, 4), (a, "Worker", 0, 2),
             (b, "Worker", 1, 2), (c, "Worker", 1, 4), (a, "Worker", 1, 2), (b, "Worker", 2, 2),
             (a, "Worker", 2, 2), (b, "Worker", 3, 2)]
    nodes = [real_gpu_node(cp, f"jobs-{i}", topology=DGX1, args=["--device-id-strategy", "index"], seed=i)
             for i in range(3)]
    with nodes[0] as n0, nodes[1] as n1, nodes[2] as n2:
        for n in (n0, n1, n2):
            n.wait_published(GPU, 8, WAIT)
        for job, role, index, gpus in order:
            _operator_pod(cp, job, role, index, gpus)
        pods = _wait_settled(cp, ns, len(order))
        assert all(p["status"]["phase"] == "Running" for p in pods), \
            {p["metadata"]["name"]: p["status"] for p in pods if p["status"]["phase"] != "Running"}
        by_job: dict[str, set[str]] = {}
        for p in pods:
            by_job.setdefault(p["metadata"]["labels"]["training.kubeflow.org/job-name"], set()).add(
                p["spec"]["nodeName"])
        assert all(len(v) == 1 for v in by_job.values()), f"a job split across nodes: {by_job}"
        held = {k: v for n in (n0, n1, n2) for k, v in n.admission.held(GPU).items()}
        assert not _plan_matches_allocation(pods, held), _plan_matches_allocation(pods, held)


def test_each_pod_of_a_job_of_unknown_size_says_the_job_so_far_truly(
        cluster: tuple[ControlPlane, ExtenderProcess, Scheduler]) -> None:
    """Pods the training operator would make, with no ownerReference (so no owner to read and no size), bound one
    after another: each placement explanation states the job so far with that pod, never "not seen yet" of an owner
    the pod does not have."""
    cp, _, _ = cluster
    ns = "unknown-size"
    cp.ensure_namespace(ns)
    with real_gpu_node(cp, "jobs-unknown", topology=DGX1, args=["--device-id-strategy", "index"]) as node:
        node.wait_published(GPU, 8, WAIT)
        texts = []
        for i in range(3):
            pod = kubeflow_pod("train", i, 2, namespace=ns, pod_group=False)
            pod["spec"].pop("schedulerName")  # this tier's kube-scheduler serves the default name
            cp.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)
            (placed,) = [p for p in _wait_settled(cp, ns, i + 1) if p["metadata"]["name"] == f"train-worker-{i}"]
            texts.append((placed["metadata"].get("annotations") or {}).get(DEFAULT_KEYS.placement, ""))
    for i, text in enumerate(texts):
        # (a long note gives way in its middle, never in its figure: extender.placement.explain)
        assert "(size unknown, no ownerReference; label " in text and f"PyTorchJob {ns}/train seen" in text, text
        assert "not readable" not in text and "not seen yet" not in text, text
        assert f"job so far, with this pod: {i + 1} of ? workers on " in text, text
