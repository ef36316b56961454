"""Kubeflow jobs as the operators really submit them: pods that carry only the operators' labels and an
ownerReference (no size annotation, no PodGroup), their owner objects served by the in-process kube-apiserver in the
shapes a real v1.36 returned (fixtures/recordings/kube-apiserver-jobs). Each job is created interleaved with another
job and is planned as a whole from its first pod: the first pod's filter reserves every GPU pod of the job, CPU-only
replicas (PS, launcher, driver) left out.

Before owners were read (issue 21), every one of these jobs had an unknown size: its first pod was planned alone.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest

from extender.membership.job import job_membership
from extender.service import Extender
from gputopo.kube import make_api_client
from sim.scheduler import SchedulerDriver
from tests.deploy.rendering import chart_scheduler_config
from tests.extender.jobs.conftest import DGX_A100, WAIT, cluster, k8s_node, rated
from tests.fakes.kubeapi.jobs import SERVED, FakeJobsKubeApi, recorded_object

NS = "ml-team"
GPU = "nvidia.com/gpu"
KUBEFLOW_OPERATORS = {"PyTorchJob": "pytorchjob-controller", "TFJob": "tfjob-controller",
                      "PaddleJob": "paddlejob-controller", "XGBoostJob": "xgboostjob-controller"}


def _container(gpus: int) -> dict[str, Any]:
    return {"name": "main", "image": "registry.invalid/train:1",
            "resources": {"limits": {GPU: str(gpus)}, "requests": {GPU: str(gpus)}} if gpus else {}}


def _pod(name: str, labels: dict[str, str], owner: dict[str, Any], gpus: int) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": NS, "labels": labels,
                         "ownerReferences": [{**owner, "controller": True, "blockOwnerDeletion": True}]},
            "spec": {"schedulerName": "gpu-topology-scheduler", "containers": [_container(gpus)]}}


def _renamed(obj: dict[str, Any], name: str) -> dict[str, Any]:
    """A second object of the same shape (another job of that kind)."""
    out = copy.deepcopy(obj)
    out["metadata"] = {**out["metadata"], "name": name, "uid": f"{out['metadata']['uid'][:-4]}beef"}
    return out


def _owner_ref(obj: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": obj["apiVersion"], "kind": obj["kind"], "name": obj["metadata"]["name"],
            "uid": obj["metadata"]["uid"]}


def kubeflow_pods(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The pods the training operator (or the MPI operator) makes of a kubeflow.org job: `<job>-<type>-<i>`,
    owned by the job; an MPIJob v2beta1's launcher is owned by a batch Job."""
    kind, name = obj["kind"], obj["metadata"]["name"]
    field = next(k for k in obj["spec"] if k.endswith("ReplicaSpecs"))
    mpi_v2 = obj["apiVersion"] == "kubeflow.org/v2beta1"
    operator = "mpi-operator" if mpi_v2 else KUBEFLOW_OPERATORS.get(kind, "mpijob-controller")
    pods = []
    for rtype, spec in obj["spec"][field].items():
        containers = spec["template"]["spec"]["containers"]
        gpus = sum(int((c.get("resources") or {}).get("limits", {}).get(GPU, 0)) for c in containers)
        for i in range(spec.get("replicas", 1)):
            labels = {"training.kubeflow.org/job-name": name, "training.kubeflow.org/operator-name": operator,
                      "training.kubeflow.org/replica-type": rtype.lower(),
                      "training.kubeflow.org/replica-index": str(i)}
            owner = _owner_ref(obj)
            if mpi_v2 and rtype == "Launcher":
                owner = {"apiVersion": "batch/v1", "kind": "Job", "name": f"{name}-launcher", "uid": "job-uid"}
            pod_name = f"{name}-{rtype.lower()}" + ("" if rtype == "Launcher" else f"-{i}")
            pods.append(_pod(pod_name, labels, owner, gpus))
    return pods


def jobset_pods(obj: dict[str, Any], jobset_name: str | None = None) -> list[dict[str, Any]]:
    """A JobSet's pods (or a TrainJob's, whose JobSet has its name): owned by the batch Jobs of its replicated
    jobs, labelled with the JobSet's name."""
    name = jobset_name or obj["metadata"]["name"]
    pods = []
    if obj["kind"] == "TrainJob":
        roles = [("node", obj["spec"]["trainer"]["numNodes"], int(obj["spec"]["trainer"]["resourcesPerNode"]
                                                                  ["limits"][GPU]))]
    else:
        roles = []
        for rj in obj["spec"]["replicatedJobs"]:
            spec = rj["template"]["spec"]
            limits = spec["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
            roles.append((rj["name"], rj.get("replicas", 1) * spec.get("parallelism", 1), int(limits.get(GPU, 0))))
    for role, count, gpus in roles:
        for i in range(count):
            labels = {"jobset.sigs.k8s.io/jobset-name": name, "jobset.sigs.k8s.io/replicatedjob-name": role,
                      "batch.kubernetes.io/job-completion-index": str(i)}
            owner = {"apiVersion": "batch/v1", "kind": "Job", "name": f"{name}-{role}-0", "uid": f"job-{role}"}
            pods.append(_pod(f"{name}-{role}-0-{i}", labels, owner, gpus))
    return pods


def lws_pods(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """A LeaderWorkerSet's pods: leaders owned by its StatefulSet, workers by each group's StatefulSet."""
    name, lwt = obj["metadata"]["name"], obj["spec"]["leaderWorkerTemplate"]
    pods = []
    for g in range(obj["spec"]["replicas"]):
        for w in range(lwt["size"]):
            template = lwt["leaderTemplate"] if w == 0 else lwt["workerTemplate"]
            gpus = int(template["spec"]["containers"][0]["resources"]["limits"][GPU])
            labels = {"leaderworkerset.sigs.k8s.io/name": name, "leaderworkerset.sigs.k8s.io/group-index": str(g),
                      "leaderworkerset.sigs.k8s.io/worker-index": str(w)}
            owner = {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name if w == 0 else f"{name}-{g}",
                     "uid": f"sts-{g}-{w == 0}"}
            pods.append(_pod(f"{name}-{g}" + (f"-{w}" if w else ""), labels, owner, gpus))
    return pods


# recorded object -> (its pods, GPU pods of one job, GPUs each, a second job of the same kind interleaved)
Case = tuple[str, Callable[[dict[str, Any]], list[dict[str, Any]]], int, int]
CASES: dict[str, Case] = {
    "PyTorchJob": ("pytorchjob-get.json", kubeflow_pods, 4, 1),
    "TFJob with PS": ("tfjob-ps-worker-get.json", kubeflow_pods, 4, 1),
    "TFJob with chief": ("tfjob-chief-worker-get.json", kubeflow_pods, 3, 2),
    "PaddleJob": ("paddlejob-get.json", kubeflow_pods, 2, 2),
    "MPIJob v2beta1": ("mpijob-v2beta1-get.json", kubeflow_pods, 2, 1),
    "MPIJob v1": ("mpijob-v1-get.json", kubeflow_pods, 2, 1),
    "TrainJob": ("trainjob-get.json", jobset_pods, 2, 4),
    "JobSet": ("jobset-get.json", jobset_pods, 4, 8),
    "LeaderWorkerSet": ("leaderworkerset-get.json", lws_pods, 4, 8),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_owner_kind_is_planned_whole_from_its_first_pod(case: str) -> None:
    file, make_pods, gpu_pods, per_pod = CASES[case]
    # the training operator's MPIJob CRD (v1) or the MPI operator's (v2beta1, the default): one name, never both
    installed = set(SERVED) - {("kubeflow.org", "v2beta1", "mpijobs")} if case == "MPIJob v1" else None
    first, second = recorded_object(file), _renamed(recorded_object(file), "second")
    with FakeJobsKubeApi(installed=installed) as fake:
        topo = rated(DGX_A100, 100.0)
        names = [f"n{i}" for i in range(16)]  # two LeaderWorkerSets of 2 groups x 4 pods x 8 GPUs fill them
        for i, name in enumerate(names):
            fake.add_node(k8s_node(name, topo, rack=f"r{i // 8}"))
        fake.add_owner(first)
        fake.add_owner(second)
        a, b = make_pods(first), make_pods(second)
        pods = [p for pair in zip(a, b, strict=True) for p in pair]  # interleaved: a0, b0, a1, b1, ...
        created = [fake.add_pod(p) for p in pods]
        api = make_api_client(host=fake.url, timeout_s=5.0)
        try:
            with cluster(api) as (ext, client):
                assert ext.cache.wait_for(lambda: len(ext.cache.owners) == 2, WAIT), ext.cache.owners.shapes
                _schedule_and_check(ext, str(client.base_url), created, first, gpu_pods, per_pod, names)
                _check_explanations(fake, created, first)
        finally:
            api.close()


def _schedule_and_check(ext: Extender, url: str, created: list[dict[str, Any]], first: dict[str, Any],
                        gpu_pods: int, per_pod: int, names: list[str]) -> None:
    driver = SchedulerDriver(url, seed=3)
    seen: set[str] = set()
    bound: dict[str, list[str]] = {}
    try:
        for pod in created:
            gpus = int(pod["spec"]["containers"][0].get("resources", {}).get("limits", {}).get(GPU, 0))
            decision = driver.schedule(pod, names)
            assert decision.node is not None, f"{pod['metadata']['name']}: {decision.reason}"
            if not gpus:
                continue  # CPU-only replicas are not part of the job's plan
            m = job_membership(pod, ext.cache.config.keys, ext.cache.groups.sizes, ext.cache.owners)
            assert m is not None
            key = m.job.key
            bound.setdefault(key, []).append(decision.node)
            if key not in seen:  # the job's first GPU pod: the whole job is planned and reserved now
                seen.add(key)
                state = ext.jobs.state(key)
                assert state is not None and state.size == gpu_pods, (m, state)
                assert state.gpus_per_pod == per_pod
                assert len(state.slots) + len(state.members) == gpu_pods, state.slots
    finally:
        driver.close()
    jobs = 2 * (2 if first["kind"] == "LeaderWorkerSet" else 1)  # a LeaderWorkerSet is a job per group
    assert len(bound) == jobs and all(len(v) == gpu_pods for v in bound.values()), bound
    for key, nodes in bound.items():  # whole and packed: as few nodes as the job's GPUs need
        assert len(set(nodes)) == -(-gpu_pods * per_pod // 8), (key, nodes)
    assert ext.jobs.open_slots() == 0


def _check_explanations(fake: FakeJobsKubeApi, created: list[dict[str, Any]], first: dict[str, Any]) -> None:
    """Each GPU pod's `<prefix>/placement` says its job, how its size is known, the planned nodes and the job's
    estimate and limit; not the per-pod "not ranked" wording (the job's filter left it its node)."""
    for pod in created:
        if not pod["spec"]["containers"][0].get("resources"):
            continue
        text = fake.pod(NS, pod["metadata"]["name"])["metadata"]["annotations"]["gpu-topology.io/placement"]
        assert f"job {NS}/" in text and "placed with this pod; planned at this bind: the job on " in text, text
        assert "GB/s all-reduce, limited by" in text and "..." not in text, text
        assert "not ranked" not in text, text
        if pod["metadata"]["name"].startswith(first["metadata"]["name"]):
            assert f"from {first['kind']} {NS}/{first['metadata']['name']}" in text, text


PYTORCH = ("kubeflow.org", "v1", "pytorchjobs")
XGBOOST = ("kubeflow.org", "v1", "xgboostjobs")


def test_a_missing_or_forbidden_kind_costs_one_look_and_the_reason_says_why() -> None:
    """The apiserver's answers as recorded: a plain-text 404 for a CRD not installed, a Forbidden Status for a kind
    RBAC does not grant. Each kind is looked at once per retry period, logged once, never an error loop; a pod of a
    job whose owner cannot be read keeps an unknown size, and says why."""
    with FakeJobsKubeApi(installed=set(SERVED) - {XGBOOST}, forbidden={PYTORCH}) as fake:
        fake.add_node(k8s_node("n0", rated(DGX_A100, 100.0)))
        api = make_api_client(host=fake.url, timeout_s=5.0)
        try:
            with cluster(api, group_retry_s=300) as (ext, _):
                assert ext.sync is not None
                by_plural = {w.label.split(".")[0]: w for w in ext.sync.owners}
                assert ext.cache.wait_for(lambda: by_plural["pytorchjobs"].absent == "forbidden"
                                          and by_plural["xgboostjobs"].absent == "not installed", WAIT)
                assert by_plural["tfjobs"].absent is None
                assert all(w.stats.errors == 0 for w in ext.sync.owners)
                pod = kubeflow_pods(recorded_object("pytorchjob-get.json"))[1]
                m = job_membership(pod, ext.cache.config.keys, ext.cache.groups.sizes, ext.cache.owners)
                assert m is not None and m.size is None
                assert m.size_note == ("PyTorchJob ml-team/pytorch-dist-mnist-nccl is not readable: kubeflow.org/v1 "
                                       "pytorchjobs forbidden")
        finally:
            api.close()
        asked = [r for r in fake.requests if r.path.startswith(("/apis/kubeflow.org/v1/pytorchjobs",
                                                                 "/apis/kubeflow.org/v1/xgboostjobs"))]
        assert len(asked) == 2  # one list each; the next look is the retry period (300 s) away


def test_a_crd_deleted_while_watched_forgets_its_objects() -> None:
    """The recorded sequence: the CRD's deletion deletes its objects (DELETED events), the apiserver closes the
    watch, and the resource then answers 404: the kind is absent, its sizes gone."""
    with FakeJobsKubeApi() as fake:
        fake.add_owner(recorded_object("paddlejob-get.json"))
        api = make_api_client(host=fake.url, timeout_s=5.0)
        try:
            with cluster(api, group_retry_s=0.1) as (ext, _):
                assert ext.cache.wait_for(lambda: len(ext.cache.owners) == 1, WAIT)
                fake.delete_group("kubeflow.org/v1", "PaddleJob", NS, "paddle-simple-gpu")
                fake.installed.discard(("kubeflow.org", "v1", "paddlejobs"))
                fake.drop_watches()
                assert ext.sync is not None
                paddle = next(w for w in ext.sync.owners if w.label.startswith("paddlejobs."))
                assert ext.cache.wait_for(lambda: paddle.absent == "not installed", WAIT)
                assert len(ext.cache.owners) == 0
                fake.installed.add(("kubeflow.org", "v1", "paddlejobs"))  # installed again: found at the next look
                fake.add_owner(recorded_object("paddlejob-get.json"))
                assert ext.cache.wait_for(lambda: len(ext.cache.owners) == 1 and paddle.absent is None, WAIT)
        finally:
            api.close()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_tfjobs_parameter_servers_land_in_the_rack_of_its_workers(seed: int) -> None:
    """Issue 21 item 3: the PS replicas ask no GPU, so they are in no plan; sent to this scheduler (the webhook's
    --whole-jobs), they go to the rack holding the job's workers. Without this, a PS landed on any node that passed
    (kube-scheduler's tie-break: half the time the other rack)."""
    obj = recorded_object("tfjob-ps-worker-get.json")
    with FakeJobsKubeApi() as fake:
        topo = rated(DGX_A100, 100.0)
        names = [f"n{i}" for i in range(8)]
        for i, name in enumerate(names):
            fake.add_node(k8s_node(name, topo, rack=f"r{i // 4}"))
        fake.add_owner(obj)
        pods = kubeflow_pods(obj)
        role = "training.kubeflow.org/replica-type"
        workers = [fake.add_pod(p) for p in pods if p["metadata"]["labels"][role] == "worker"]
        servers = [fake.add_pod(p) for p in pods if p["metadata"]["labels"][role] == "ps"]
        assert len(workers) == 4 and len(servers) == 2
        api = make_api_client(host=fake.url, timeout_s=5.0)
        try:
            with cluster(api) as (ext, client):
                assert ext.cache.wait_for(lambda: len(ext.cache.owners) == 1, WAIT)
                # the chart's configuration with webhook.wholeJobs: no managedResources, so kube-scheduler asks the
                # extender about the PS too (with the default one it never would: sim.scheduler follows the rule)
                driver = SchedulerDriver(str(client.base_url), seed=seed,
                                         config=chart_scheduler_config({"webhook": {"wholeJobs": True}}))
                try:
                    worker_nodes = {driver.schedule(p, names).node for p in workers}
                    ps_nodes = [driver.schedule(p, names).node for p in servers]
                finally:
                    driver.close()
        finally:
            api.close()
    assert None not in worker_nodes and None not in ps_nodes
    worker_racks = {int(n[1:]) // 4 for n in worker_nodes if n}
    assert {int(n[1:]) // 4 for n in ps_nodes if n} <= worker_racks, (worker_nodes, ps_nodes)
