"""examples/jobs/ do what they say: the pods their controllers would create (with the labels the training operator,
the MPI operator, JobSet and Kueue write) are planned as one job by the extender, through the verbs, and land whole."""

from __future__ import annotations

import copy
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from extender.config import ExtenderConfig
from extender.service import Extender
from sim.scheduler import SchedulerDriver
from tests.extender.conftest import running
from tests.extender.jobs.conftest import DGX_A100, RACK
from tests.helpers.paths import REPO

EXAMPLES = REPO / "examples" / "jobs"


def _pod(template: dict[str, Any], name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    meta = copy.deepcopy(template.get("metadata") or {})
    meta.update(name=name, namespace=namespace, uid=str(uuid.uuid4()))
    meta["labels"] = {**meta.get("labels", {}), **labels}
    return {"metadata": meta, "spec": copy.deepcopy(template["spec"]), "status": {"phase": "Pending"}}


def controller_pods(path: Path) -> list[dict[str, Any]]:
    """The GPU pods the example's controller creates, labelled as it labels them."""
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    first = docs[0]
    ns, name = first["metadata"]["namespace"], first["metadata"]["name"]
    pods: list[dict[str, Any]] = []
    if first["kind"] == "PyTorchJob":
        for rtype, spec in first["spec"]["pytorchReplicaSpecs"].items():
            for i in range(spec["replicas"]):
                pods.append(_pod(spec["template"], f"{name}-{rtype.lower()}-{i}", ns, {
                    "training.kubeflow.org/job-name": name, "training.kubeflow.org/operator-name":
                    "pytorchjob-controller", "training.kubeflow.org/replica-type": rtype.lower(),
                    "training.kubeflow.org/replica-index": str(i)}))
    elif first["kind"] == "MPIJob":
        for rtype, spec in first["spec"]["mpiReplicaSpecs"].items():
            for i in range(spec["replicas"]):
                pods.append(_pod(spec["template"], f"{name}-{rtype.lower()}-{i}", ns, {
                    "training.kubeflow.org/job-name": name, "training.kubeflow.org/operator-name": "mpi-operator",
                    "training.kubeflow.org/job-role": rtype.lower(), "training.kubeflow.org/replica-index": str(i)}))
    elif first["kind"] == "JobSet":
        for rjob in first["spec"]["replicatedJobs"]:
            job = rjob["template"]["spec"]
            for i in range(job["completions"]):
                pods.append(_pod(job["template"], f"{name}-{rjob['name']}-0-{i}", ns, {
                    "jobset.sigs.k8s.io/jobset-name": name, "jobset.sigs.k8s.io/replicatedjob-name": rjob["name"],
                    "jobset.sigs.k8s.io/job-index": "0", "batch.kubernetes.io/job-completion-index": str(i)}))
    else:
        pods = [_pod(d, d["metadata"]["name"], d["metadata"]["namespace"], {}) for d in docs]
    return [p for p in pods if any(
        (c.get("resources") or {}).get("limits", {}).get("nvidia.com/gpu") for c in p["spec"]["containers"])]


@pytest.mark.parametrize("example", ["pytorchjob.yaml", "mpijob.yaml", "jobset.yaml", "kueue-pod-group.yaml"])
def test_an_example_is_planned_as_one_job_and_lands_whole(tmp_path: Path, example: str) -> None:
    pods = controller_pods(EXAMPLES / example)
    nodes = [f"n{i}" for i in range(6)]
    inventory = tmp_path / "inventory.yaml"
    inventory.write_text(yaml.safe_dump({"nodes": [
        {"name": n, "topology": str(DGX_A100), "labels": {RACK: f"r{i // 3}"}} for i, n in enumerate(nodes)]}))
    ext = Extender.standalone(inventory, ExtenderConfig())
    with running(ext) as client:
        driver = SchedulerDriver(str(client.base_url), seed=3)
        try:
            placed = [driver.schedule(p, nodes).node for p in pods]
        finally:
            driver.close()
        text = client.get("/metrics").text
    assert None not in placed, placed
    assert 'gpu_extender_job_plans_total{outcome="planned"} 1.0' in text  # one plan for the whole job
    assert 'gpu_extender_reservations_ended_total{why="settled"} ' + f"{len(pods)}.0" in text  # every slot taken
    gpus = sum(int(c["resources"]["limits"]["nvidia.com/gpu"]) for p in pods for c in p["spec"]["containers"])
    assert len(set(placed)) == -(-gpus // 8)  # as few nodes as the job's GPUs need (one node where it fits)
