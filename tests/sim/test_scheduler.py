"""sim/scheduler.py plays kube-scheduler's rule for which pods reach the extender (HTTPExtender.IsInterested), from
the managedResources of the configuration the deployment ships, and a TFJob's parameter servers created before its
workers land in the workers' rack when they reach the extender (the chart's webhook.wholeJobs configuration).

The docs' claims about which pods the extender sees rest on this rule, not on a driver that asks it about every pod:
with the shipped configuration a pod asking no GPU (a PS) is placed by kube-scheduler alone."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from gputopo.kube import make_api_client
from sim.scheduler import (
    DEFAULT_CONFIG,
    EVERY_POD,
    SKIPPED,
    SchedulerDriver,
    default_managed_resources,
    interested,
    managed_resources,
    scheduler_config,
)
from tests.deploy.rendering import chart_scheduler_config
from tests.extender.jobs.conftest import DGX_A100, RACK, WAIT, cluster, k8s_node, rated
from tests.fakes.kubeapi.jobs import FakeJobsKubeApi, recorded_object

NS = "ml-team"
GPU = "nvidia.com/gpu"
ROLE = "training.kubeflow.org/replica-type"


def _chart_config(values: dict[str, Any]) -> dict[str, Any]:
    return chart_scheduler_config(values)


def _pod(resources: dict[str, Any] | None = None, init: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "c", "resources": resources or {}}]}
    if init is not None:
        spec["initContainers"] = [{"name": "i", "resources": init}]
    return {"metadata": {"name": "p", "namespace": "default", "uid": "u"}, "spec": spec}


def test_the_driver_reads_the_same_managed_resources_as_the_chart() -> None:
    """The shipped static configuration (DEFAULT_CONFIG), which the driver reads, lists what the chart renders
    with its defaults; with webhook.wholeJobs the chart lists none, and the driver then asks about every pod."""
    chart = managed_resources(_chart_config({}))
    assert default_managed_resources() == chart == managed_resources(scheduler_config(DEFAULT_CONFIG))
    assert {GPU, f"{GPU}.shared", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-1g.10gb.shared"} <= chart
    assert managed_resources(_chart_config({"webhook": {"wholeJobs": True}})) == EVERY_POD


def test_without_the_repository_the_driver_lists_the_same_names(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Any) -> None:
    """An installed sim (no deploy/ beside it) computes the names the shipped configuration lists."""
    import sim.scheduler

    shipped = default_managed_resources()
    monkeypatch.setattr(sim.scheduler, "DEFAULT_CONFIG", tmp_path / "absent.yaml")
    assert sim.scheduler.default_managed_resources() == shipped


@pytest.mark.parametrize(("pod", "managed", "asked"), [
    (_pod({"limits": {GPU: "1"}}), {GPU}, True),
    (_pod({"requests": {GPU: "0"}}), {GPU}, True),  # named: the count does not matter
    (_pod(init={"limits": {GPU: "1"}}), {GPU}, True),  # init containers count
    (_pod({"limits": {f"{GPU}.shared": "1"}}), {GPU}, False),  # exact names only: the platform team's defect
    (_pod({"requests": {"cpu": "2"}}), {GPU}, False),  # a parameter server
    (_pod({"requests": {"cpu": "2"}}), EVERY_POD, True),  # none listed: every pod
])
def test_kube_schedulers_rule_for_which_pods_reach_the_extender(pod: dict[str, Any], managed: set[str],
                                                                 asked: bool) -> None:
    assert interested(pod, frozenset(managed)) is asked


def test_a_pod_the_extender_is_not_asked_about_is_bound_without_it() -> None:
    driver = SchedulerDriver("http://127.0.0.1:9", seed=1)  # nothing listens: any call would fail
    try:
        decision = driver.schedule(_pod({"requests": {"cpu": "2"}}), ["n0", "n1"])
    finally:
        driver.close()
    assert decision.node in ("n0", "n1") and decision.reason == SKIPPED


def _tfjob(name: str, uid: str, workers: int) -> dict[str, Any]:
    obj = copy.deepcopy(recorded_object("tfjob-ps-worker-get.json"))  # PS 2 x no GPU, Worker 4 x 1 GPU
    obj["metadata"] = {**obj["metadata"], "name": name, "uid": uid}
    obj["spec"]["tfReplicaSpecs"]["Worker"]["replicas"] = workers
    return obj


def _tfjob_pods(obj: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(parameter servers, workers) as the training operator makes them: labels and the controller reference."""
    name = obj["metadata"]["name"]
    owner = {"apiVersion": obj["apiVersion"], "kind": "TFJob", "name": name, "uid": obj["metadata"]["uid"],
             "controller": True, "blockOwnerDeletion": True}
    out: dict[str, list[dict[str, Any]]] = {"ps": [], "worker": []}
    for rtype, spec in obj["spec"]["tfReplicaSpecs"].items():
        gpus = int(spec["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {}).get(GPU, 0))
        for i in range(spec["replicas"]):
            labels = {"training.kubeflow.org/job-name": name, "training.kubeflow.org/operator-name": "tfjob-controller",
                      ROLE: rtype.lower(), "training.kubeflow.org/replica-index": str(i)}
            resources = {"limits": {GPU: str(gpus)}, "requests": {GPU: str(gpus)}} if gpus else {
                "requests": {"cpu": "2", "memory": "4Gi"}}
            out[rtype.lower()].append({
                "metadata": {"name": f"{name}-{rtype.lower()}-{i}", "namespace": NS, "labels": labels,
                             "ownerReferences": [owner]},
                "spec": {"schedulerName": "gpu-topology-scheduler",
                         "containers": [{"name": "tensorflow", "image": "registry.invalid/tf:1",
                                         "resources": resources}]}})
    return out["ps"], out["worker"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_parameter_servers_created_first_land_in_the_rack_their_workers_then_take(seed: int) -> None:
    """Issue B's seed shape: 4 TFJobs of 2 CPU-only PS and 4 one-GPU workers on 8 DGX A100 in 2 racks, PS created
    first (the operator walks replica types in map order). Through the chart's wholeJobs configuration the first
    PS plans its job's workers from the TFJob (size and GPUs per pod), so both PS score the rack of those slots, and
    the workers then take them; with the shipped default configuration the PS never reach the extender."""
    topo = rated(DGX_A100, 100.0)
    names = [f"n{i}" for i in range(8)]
    whole_jobs = _chart_config({"webhook": {"wholeJobs": True}})
    with FakeJobsKubeApi() as fake:
        for i, name in enumerate(names):
            fake.add_node(k8s_node(name, topo, rack=f"r{i // 4}"))
        jobs = [_tfjob(f"tf-{j}", f"0a690f19-1589-4a47-a693-24952200000{j}", 4) for j in range(4)]
        pods = []
        for obj in jobs:
            fake.add_owner(obj)
            ps, workers = _tfjob_pods(obj)
            pods.append(([fake.add_pod(p) for p in ps], [fake.add_pod(p) for p in workers]))
        api = make_api_client(host=fake.url, timeout_s=5.0)
        try:
            with cluster(api) as (ext, client):
                assert ext.cache.wait_for(lambda: len(ext.cache.owners) == 4, WAIT)
                default = SchedulerDriver(str(client.base_url), seed=seed)
                try:
                    assert default.schedule(pods[0][0][0], names).reason == SKIPPED
                finally:
                    default.close()
                driver = SchedulerDriver(str(client.base_url), seed=seed, config=whole_jobs)
                try:
                    placed = [([driver.schedule(p, names) for p in ps], [driver.schedule(p, names) for p in workers])
                              for ps, workers in pods]
                finally:
                    driver.close()
            explained = {p["metadata"]["name"]: (fake.pod(NS, p["metadata"]["name"]) or {})["metadata"].get(
                "annotations", {}).get("gpu-topology.io/placement", "") for ps, _ in pods for p in ps}
        finally:
            api.close()
    rack = {n: fake_rack for n, fake_rack in ((f"n{i}", f"r{i // 4}") for i in range(8))}
    for (ps, workers), obj in zip(placed, jobs, strict=True):
        assert all(d.node for d in [*ps, *workers]), [d.reason for d in [*ps, *workers]]
        worker_racks = {rack[d.node] for d in workers if d.node}
        assert {rack[d.node] for d in ps if d.node} <= worker_racks, (obj["metadata"]["name"], ps, workers)
    for name, text in explained.items():
        assert "asks no GPU" in text and "GPU pods placed or planned" in text and RACK not in text, (name, text)
