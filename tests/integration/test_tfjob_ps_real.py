"""A TFJob's parameter servers, created before its workers as the training operator often creates them, land with
their workers through the real components: kube-apiserver and kube-scheduler v1.36.2 (tests/helpers/controlplane.py)
with the chart's objects rendered with `webhook.wholeJobs: true` (the MutatingWebhookConfiguration's matchConditions
in front of the real `gpu-extender webhook --whole-jobs`, the KubeSchedulerConfiguration's extender stanza in front
of the real `gpu-extender serve`), and a TFJob CRD (kubeflow.org/v1, a schema-less stand-in for the training
operator's: the extender reads only the replica specs).

The platform team's seed shape: 4 TFJobs of 2 CPU-only PS and 4 one-GPU workers; 8 DGX A100 nodes in 2 racks
(NVIDIA topograph's leaf label, the rack of docs/jobs.md). Before the fix none of the 8 PS reached our scheduler
(the webhook's matchConditions asked for the GPU resource); with them widened by hand, kube-scheduler never asked
the extender (managedResources), and with that removed a PS that came first went wherever kube-scheduler liked.
Now each must land in the rack of its job's workers and say so in its placement explanation.

Skips, naming why, where the Kubernetes binaries (shared/kube beside the clone) or etcd are absent."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from gputopo.contract import DEFAULT_KEYS
from tests.extender.jobs.conftest import DGX_A100, RACK, rated
from tests.helpers.controlplane import ControlPlane, start_webhook, tidied, wait_until

pytestmark = [pytest.mark.timeout(300)]

NS = "ml-team"
GPU = "nvidia.com/gpu"
SCHEDULER = "gpu-topology-scheduler"
JOBS, PS, WORKERS = 4, 2, 4
NODES, PER_RACK = 8, 4
WAIT_S = 90.0  # liveness bound on a loaded 2-core machine, never a performance figure
CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "tfjobs.kubeflow.org"},
    "spec": {"group": "kubeflow.org", "scope": "Namespaced",
             "names": {"plural": "tfjobs", "singular": "tfjob", "kind": "TFJob", "listKind": "TFJobList"},
             "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                           "schema": {"openAPIV3Schema": {"type": "object",
                                                          "x-kubernetes-preserve-unknown-fields": True}}}]},
}


def _chart() -> list[dict[str, Any]]:
    from tests.deploy.rendering import ChartVariant, render_chart

    return render_chart(ChartVariant("gpu-topology", "gpu-topology", {"webhook": {"wholeJobs": True}}))


def _tfjob(name: str) -> dict[str, Any]:
    """Shaped like the recorded tf-dist-mnist-ps (fixtures/recordings/kube-apiserver-jobs): PS with cpu "2",
    workers with one GPU in limits only."""
    def template(resources: dict[str, Any]) -> dict[str, Any]:
        return {"spec": {"containers": [{"name": "tensorflow", "image": "registry.invalid/tf-dist-mnist:1",
                                         "resources": resources}]}}

    return {"apiVersion": "kubeflow.org/v1", "kind": "TFJob", "metadata": {"name": name, "namespace": NS},
            "spec": {"runPolicy": {"cleanPodPolicy": "None"}, "tfReplicaSpecs": {
                "PS": {"replicas": PS, "restartPolicy": "Never",
                       "template": template({"requests": {"cpu": "2", "memory": "4Gi"}})},
                "Worker": {"replicas": WORKERS, "restartPolicy": "OnFailure",
                           "template": template({"limits": {GPU: 1}})}}}}


def _operator_pod(job: dict[str, Any], rtype: str, index: int) -> dict[str, Any]:
    """A pod as the training operator (v1.9) makes it: `<job>-<type>-<i>`, its labels, the controller reference to
    the TFJob, TF_CONFIG, the template's resources, no schedulerName (no gang scheduler configured)."""
    name = job["metadata"]["name"]
    spec = job["spec"]["tfReplicaSpecs"][rtype]
    container = dict(spec["template"]["spec"]["containers"][0])
    cluster = {r.lower(): [f"{name}-{r.lower()}-{i}.{NS}.svc:2222" for i in range(s["replicas"])]
               for r, s in job["spec"]["tfReplicaSpecs"].items()}
    tf_config = yaml.safe_dump({"cluster": cluster, "task": {"type": rtype.lower(), "index": index}},
                               default_flow_style=True).strip()
    container["env"] = [{"name": "TF_CONFIG", "value": tf_config}]
    return {"metadata": {
        "name": f"{name}-{rtype.lower()}-{index}", "namespace": NS,
        "labels": {"training.kubeflow.org/job-name": name, "training.kubeflow.org/operator-name": "tfjob-controller",
                   "training.kubeflow.org/replica-type": rtype.lower(),
                   "training.kubeflow.org/replica-index": str(index),
                   **({"training.kubeflow.org/job-role": "master"} if rtype == "Chief" else {})},
        "ownerReferences": [{"apiVersion": "kubeflow.org/v1", "kind": "TFJob", "name": name,
                             "uid": job["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]},
        "spec": {"restartPolicy": spec["restartPolicy"], "terminationGracePeriodSeconds": 0,
                 "containers": [container]}}


@pytest.fixture(scope="module")
def cluster(real_control_plane: ControlPlane) -> Iterator[ControlPlane]:
    objects = _chart()
    with tidied(real_control_plane) as cp:
        cp.ensure_namespace(NS)
        cp.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", CRD)
        wait_until("the TFJob CRD served", lambda: cp.api().get(f"/apis/kubeflow.org/v1/namespaces/{NS}/tfjobs")
                   .status_code == 200, 60)
        topo = rated(DGX_A100, 100.0)
        for i in range(NODES):
            cp.add_gpu_node(f"n{i}", topo, labels={RACK: f"r{i // PER_RACK}"})
        scheduler_pod = next(o for o in objects if o["kind"] == "Deployment"
                             and o["metadata"]["name"].endswith("-scheduler"))["spec"]["template"]["spec"]
        chart_args = next(c["args"] for c in scheduler_pod["containers"] if c["name"] == "extender")
        best = [a for a in chart_args if a == "--filter-best"]  # the chart's stanza then has no prioritize
        extender = cp.start_extender(extra=["--job-owner-kinds", "TFJob", "--log-level", "debug", *best])
        (cm,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-scheduler-config")]
        config = yaml.safe_load(cm["data"]["scheduler-config.yaml"])
        (stanza,) = config["extenders"]
        assert "managedResources" not in stanza  # webhook.wholeJobs: every pod of this scheduler reaches it
        cp.start_scheduler([{**stanza, "urlPrefix": extender.url}], name=SCHEDULER,
                           extra_config={"profiles": config["profiles"]})
        (hook_config,) = [o for o in objects if o["kind"] == "MutatingWebhookConfiguration"]
        (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-webhook")]
        args = [a for a in deployment["spec"]["template"]["spec"]["containers"][0]["args"][1:]
                if a.split("=", 1)[0] in ("--scheduler-name", "--resource-name", "--annotation-prefix",
                                          "--extra-resources", "--whole-jobs")]
        assert "--whole-jobs" in args
        start_webhook(cp, hook_config["webhooks"][0], *args)
        yield cp


def _extender_log(cp: ControlPlane) -> str:
    return next((p.log.read_text(errors="replace") for p in cp.procs if p.name == "gpu-extender"), "")


def test_parameter_servers_created_first_land_in_the_rack_of_their_workers(cluster: ControlPlane) -> None:
    cp = cluster
    started = time.monotonic()
    jobs = [cp.request("POST", f"/apis/kubeflow.org/v1/namespaces/{NS}/tfjobs", _tfjob(f"tf-{j}"))
            for j in range(JOBS)]
    # the operator makes pods once it has seen its TFJob; the extender sizes the job from the same object
    wait_until("the extender watching every TFJob", lambda: _extender_log(cp).count("extender.owners.seen") >= JOBS,
               30)
    names = []
    for job in jobs:  # PS first, then the workers: the order Go's map iteration often gives the operator
        for rtype, count in (("PS", PS), ("Worker", WORKERS)):
            for i in range(count):
                pod = cp.request("POST", f"/api/v1/namespaces/{NS}/pods", _operator_pod(job, rtype, i))
                names.append(pod["metadata"]["name"])
    pods: dict[str, dict[str, Any]] = {}

    def all_bound() -> bool:
        pods.update({p["metadata"]["name"]: p for p in cp.list_items(f"/api/v1/namespaces/{NS}/pods")})
        return all(pods.get(n, {}).get("spec", {}).get("nodeName") for n in names)

    try:
        wait_until(f"{len(names)} pods bound", all_bound, WAIT_S)
    except RuntimeError:
        pending = {n: (pods.get(n, {}).get("spec", {}).get("schedulerName"),
                       [c.get("message") for c in pods.get(n, {}).get("status", {}).get("conditions", [])])
                   for n in names if not pods.get(n, {}).get("spec", {}).get("nodeName")}
        pytest.fail(f"not bound after {WAIT_S} s: {pending}")
    elapsed = time.monotonic() - started
    rack = {f"n{i}": f"r{i // PER_RACK}" for i in range(NODES)}
    missed, unexplained = [], []
    for job in jobs:
        name = job["metadata"]["name"]
        workers = [pods[f"{name}-worker-{i}"] for i in range(WORKERS)]
        servers = [pods[f"{name}-ps-{i}"] for i in range(PS)]
        assert all(p["spec"]["schedulerName"] == SCHEDULER for p in [*workers, *servers]), "the webhook's job"
        assert all(DEFAULT_KEYS.plan in (p["metadata"].get("annotations") or {}) for p in workers)
        worker_racks = {rack[p["spec"]["nodeName"]] for p in workers}
        for ps in servers:
            node = ps["spec"]["nodeName"]
            if rack[node] not in worker_racks:
                missed.append((ps["metadata"]["name"], node, sorted(worker_racks)))
            text = (ps["metadata"].get("annotations") or {}).get(DEFAULT_KEYS.placement, "")
            if not (f"job {NS}/" in text and "asks no GPU" in text and f"in rack {rack[node]}" in text):
                unexplained.append((ps["metadata"]["name"], text))
    assert not missed, f"PS outside their workers' rack: {missed}"
    assert not unexplained, f"PS without a placement explanation: {unexplained}"
    assert "extender.job.planned_ahead" in _extender_log(cp)  # the PS came first and planned its job
    print(f"{len(names)} pods bound in {elapsed:.1f} s")
