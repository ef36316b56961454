"""The extender makes the real kube-scheduler v1.36.2 prefer the DRA node whose best free GPU set is best, for a claim
template and for a plain `nvidia.com/gpu: N` served through the DeviceClass's extendedResourceName, pods unchanged.

Four DRA nodes whose free 4-GPU sets all pass the "best 4 GPUs" template's fast tier (>= 100 GB/s), so the DRA
Score plugin rates them alike: two HGX H100 4-GPU (124 GB/s), an HGX A100 8-GPU (240 GB/s) and a p5 H100 8-GPU
(371 GB/s). Without the extender both pods land on a node drawn among equals (both on the p5 one time in 16);
with the extender's two stanzas (tests/helpers/dra_nodes.dra_stanzas) both land on the p5 node.

Skips, naming why, where the Kubernetes binaries (shared/kube beside the clone) or etcd are absent."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from gputopo.core import allreduce_gbps
from gputopo.discovery.loader import load_topology_file
from tests.helpers.controlplane import ControlPlane, tidied
from tests.helpers.dra_nodes import (
    add_dra_node,
    allocated_gpus,
    claim_of,
    dra_stanzas,
    install_classes,
    plain_pod,
    template_pod,
)
from tests.helpers.paths import REPO

pytestmark = [pytest.mark.timeout(180)]

NAMESPACE = "dra-best-node"
TOPOLOGIES = REPO / "fixtures" / "topologies"
NODES = {
    "a-h100x4": "hgx-h100-4gpu-nv6-nccl1617.txt",
    "b-a100x8": "hgx-a100-8gpu-epyc7763-pleiades.txt",
    "c-h100x4": "hgx-h100-4gpu-nv6-nccl1617.txt",
    "d-p5": "aws-p5.48xlarge.txt",
}
BEST = "d-p5"
WAIT_S = 60.0  # liveness bound of one allocation on a loaded 2-core machine, never a performance figure
SCHEDULER = "gpu-topology-scheduler"
EXTENDER_URL: list[str] = []  # the module's extender, for the second scheduler of the webhook test


@pytest.fixture(scope="module")
def cluster(real_control_plane: ControlPlane) -> Iterator[ControlPlane]:
    with tidied(real_control_plane) as cp:
        for node, fixture in NODES.items():
            add_dra_node(cp, node, load_topology_file(TOPOLOGIES / fixture))
        install_classes(cp, NAMESPACE)
        ext = cp.start_extender(name="gpu-extender-dra")
        EXTENDER_URL.append(f"http://127.0.0.1:{ext.port}")
        sched = cp.start_scheduler(dra_stanzas(EXTENDER_URL[-1]))
        try:
            yield cp
        finally:
            cp.stop_scheduler(sched)


def _placed(cp: ControlPlane, name: str) -> tuple[str, tuple[int, ...]]:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        pod = cp.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
        claim = claim_of(cp, NAMESPACE, name) if pod["spec"].get("nodeName") else None
        got = allocated_gpus(claim) if claim is not None else None
        if got is not None:
            return got
        time.sleep(0.2)
    why = [c.get("message") for c in pod.get("status", {}).get("conditions", [])]
    pytest.fail(f"{name} never placed with an allocated claim: {why}")


def test_a_template_pod_naming_no_scheduler_reaches_it_through_the_webhook(cluster: ControlPlane) -> None:
    """The chart's second-scheduler mode with `dra.enabled`: the MutatingWebhookConfiguration's matchConditions let
    a pod whose GPUs come through a claim reach the real `gpu-extender webhook --dra-claims`, which gives it the
    topology-aware scheduler, whose extender ranks the DRA nodes: the pod needs no change. (First in the module:
    the best node is still empty.)"""
    from tests.deploy.rendering import ChartVariant, render_chart
    from tests.helpers.controlplane import start_webhook, wait_until

    cp = cluster
    objects = render_chart(ChartVariant("gpu-topology", "gpu-topology", {"dra": {"enabled": True}}))
    (hook_config,) = [o for o in objects if o["kind"] == "MutatingWebhookConfiguration"]
    (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-webhook")]
    args = [a for a in deployment["spec"]["template"]["spec"]["containers"][0]["args"][1:]
            if a.split("=", 1)[0] in ("--scheduler-name", "--resource-name", "--annotation-prefix", "--dra-claims")]
    assert "--dra-claims" in args
    profile = {"schedulerName": SCHEDULER, "percentageOfNodesToScore": 100}
    sched = cp.start_scheduler(dra_stanzas(EXTENDER_URL[-1]), name=SCHEDULER, extra_config={"profiles": [profile]})
    webhook = start_webhook(cp, hook_config["webhooks"][0], *args, name="gpu-topology-webhook-dra")
    name = "four-via-webhook"
    try:
        cp.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", template_pod(name, 4))
        assert cp.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")["spec"]["schedulerName"] == SCHEDULER
        node, gpus = _placed(cp, name)
        assert node == BEST, (node, gpus)
    finally:
        cp.request("DELETE", "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/"
                   "gpu-topology-webhook-dra", ok=(200, 202, 404))
        webhook.stop()
        cp.procs.remove(webhook)
        cp.stop_scheduler(sched)
        cp.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}", ok=(200, 202, 404),
                   gracePeriodSeconds=0)
        # its claim goes with it (kube-controller-manager), freeing the best node for the tests that follow
        wait_until("the pod's claim gone", lambda: claim_of(cp, NAMESPACE, name) is None, WAIT_S)


@pytest.mark.parametrize("kind", ["template", "plain"])
def test_a_4_gpu_pod_lands_on_the_node_with_the_best_free_set(cluster: ControlPlane, kind: str) -> None:
    name = f"four-{kind}"
    pod = template_pod(name, 4) if kind == "template" else plain_pod(name, 4)
    cluster.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", pod)
    node, gpus = _placed(cluster, name)
    assert node == BEST, (kind, node, gpus)
    assert len(gpus) == 4
    topo = load_topology_file(TOPOLOGIES / NODES[BEST])
    assert allreduce_gbps(topo, gpus) > 300, gpus

