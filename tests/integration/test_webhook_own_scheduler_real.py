"""A pod that names the topology-aware scheduler itself (examples/jobs/pytorchjob.yaml, jobset.yaml) still gets its
topology annotations as node affinity, through the real kube-apiserver v1.36.2 (tests/helpers/controlplane.py)
evaluating the MutatingWebhookConfiguration's matchConditions as the chart and kustomize render them, in front of
the real `gpu-extender webhook` with the args they give it.

The Cluster Autoscaler never calls the extender: it sees `require-nvlink` only as the affinity the webhook adds.
The matchConditions sent the webhook only pods naming no scheduler, so a pod naming ours never reached it, and CA
found it a place on a PCIe node every loop and added nothing. A pod naming another scheduler must still never be
sent (the webhook would leave it alone anyway: the condition spares it the call and its failure modes).

Skips, naming why, where the Kubernetes binaries (shared/kube beside the clone) or etcd are absent."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gputopo.contract import DEFAULT_KEYS, NVLINK_FABRICS
from tests.helpers.controlplane import ControlPlane, Proc, metric_sum, start_webhook, tidied

pytestmark = [pytest.mark.timeout(300)]

GPU = "nvidia.com/gpu"
SCHEDULER = "gpu-topology-scheduler"
REVIEWS = "gpu_extender_webhook_reviews_total"
ARGS = ("--scheduler-name", "--resource-name", "--annotation-prefix", "--extra-resources", "--replica-resources",
        "--whole-jobs")


def _rendered(source: str) -> list[dict[str, Any]]:
    from tests.deploy.rendering import DEPLOY, ChartVariant, kustomize_build, render_chart

    if source == "chart":
        return render_chart(ChartVariant("gpu-topology", "gpu-topology", {"webhook": {"enabled": True}}))
    return kustomize_build(DEPLOY / "webhook")


@pytest.fixture(scope="module", params=["chart", "kustomize"])
def webhook(request: pytest.FixtureRequest, real_control_plane: ControlPlane
            ) -> Iterator[tuple[ControlPlane, str, Proc]]:
    """The webhook as `request.param` deploys it: its configuration (rules, selectors, matchConditions) and the
    args that say what it manages; a namespace of each (a deleted one lingers while it terminates)."""
    objects = _rendered(request.param)
    ns = f"own-scheduler-{request.param}"
    with tidied(real_control_plane) as cp:
        cp.ensure_namespace(ns)
        (hook_config,) = [o for o in objects if o["kind"] == "MutatingWebhookConfiguration"]
        (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-webhook")]
        args = [a for a in deployment["spec"]["template"]["spec"]["containers"][0]["args"][1:]
                if a.split("=", 1)[0] in ARGS]
        assert f"--scheduler-name={SCHEDULER}" in args, args
        yield cp, ns, start_webhook(cp, hook_config["webhooks"][0], *args, name=f"webhook-{request.param}")


def _created(cp: ControlPlane, ns: str, name: str, scheduler: str) -> dict[str, Any]:
    """The pod as the API server would store it (dry run: admission runs, nothing is stored): 2 GPUs that must be
    joined by NVLink, naming `scheduler`."""
    pod = {"metadata": {"name": name, "annotations": {DEFAULT_KEYS.require_nvlink: "true"}},
           "spec": {"schedulerName": scheduler, "containers": [{
               "name": "train", "image": "registry.invalid/none:0", "resources": {"limits": {GPU: "2"}}}]}}
    return cp.request("POST", f"/api/v1/namespaces/{ns}/pods", pod, dryRun="All")  # type: ignore[no-any-return]


def _reviews(proc: Proc) -> dict[str, float]:
    """The webhook's count of answered reviews by outcome, counted before each answer is sent (its metrics port
    is the one its latest start logged)."""
    *_, port = (json.loads(line)["metrics_port"] for line in proc.log_tail(1_000_000).splitlines()
                if '"extender.webhook.listening"' in line)
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {o: metric_sum(text, REVIEWS, outcome=o) for o in ("already_ours", "other_scheduler")}


def test_a_pod_naming_our_scheduler_gets_its_affinity_and_one_naming_another_is_never_sent(
        webhook: tuple[ControlPlane, str, Proc]) -> None:
    cp, ns, proc = webhook
    before = _reviews(proc)
    other = _created(cp, ns, "other-named", "other-scheduler")
    ours = _created(cp, ns, "ours-named", SCHEDULER)
    assert ours["spec"]["schedulerName"] == SCHEDULER
    nvlink = {"key": DEFAULT_KEYS.fabric_label, "operator": "In", "values": list(NVLINK_FABRICS)}
    terms = ours["spec"].get("affinity", {}).get("nodeAffinity", {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms")
    assert terms and all(nvlink in t["matchExpressions"] for t in terms), ours["spec"].get("affinity")
    assert other["spec"]["schedulerName"] == "other-scheduler"
    assert "affinity" not in other["spec"], other["spec"]["affinity"]
    after = _reviews(proc)
    assert after["already_ours"] == before["already_ours"] + 1
    assert after["other_scheduler"] == before["other_scheduler"], "matchConditions let another scheduler's pod through"
