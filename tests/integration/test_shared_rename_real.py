"""A pod asking for a shared GPU under NVIDIA's `renameByDefault: true` (`nvidia.com/gpu.shared`) reaches the
extender through the real components: kube-apiserver and kube-scheduler v1.36.2 (tests/helpers/controlplane.py)
with the chart's own objects, its MutatingWebhookConfiguration (matchConditions as rendered) in front of the real
`gpu-extender webhook`, and its KubeSchedulerConfiguration's extender stanza (managedResources as rendered) in
front of the real `gpu-extender serve`.

The platform team's defect: managedResources named `nvidia.com/gpu` and the MIG names only, so kube-scheduler, which
asks an extender only about pods naming one of its managedResources (HTTPExtender.IsInterested, exact names), bound
such a pod by itself: no plan annotation, no distinct-GPU rule, no extender log line; and the webhook's
matchConditions never let the pod through, so it was not sent to this scheduler at all. The control scheduler,
configured as the chart was before (no shared names), shows the real rule: the same pod is bound without the
extender.

Skips, naming why, where the Kubernetes binaries (shared/kube beside the clone) or etcd are absent."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from gputopo.contract import DEFAULT_KEYS, parse_plan
from gputopo.core import NodeState, state_to_json, topology_to_json
from gputopo.core.codec import SharedGpu, SharedResource, Sharing
from gputopo.discovery.loader import load_topology_file
from tests.helpers.controlplane import ControlPlane, start_webhook, tidied
from tests.helpers.paths import SHARED as SHARED_DIR

pytestmark = [pytest.mark.timeout(240)]

NS = "inference"
GPU = "nvidia.com/gpu"
SHARED = "nvidia.com/gpu.shared"
SCHEDULER = "gpu-topology-scheduler"
BEFORE = "before-the-fix"  # a scheduler configured as the chart was: managedResources without the shared names
A100 = SHARED_DIR / "topologies" / "hgx-a100-8gpu-epyc7763-pleiades.txt"
RENAME_BY_DEFAULT = ("version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
                     "    - name: nvidia.com/gpu\n      replicas: 4\n      devices: [0, 1, 2, 3]\n")
WAIT_S = 60.0  # liveness bound on a loaded 2-core machine, never a performance figure


def _chart() -> list[dict[str, Any]]:
    from tests.deploy.rendering import ChartVariant, render_chart

    return render_chart(ChartVariant("gpu-topology", "gpu-topology", {
        "plugin": {"sharing": {"enabled": True, "configs": {"inference": RENAME_BY_DEFAULT}}}}))


def _scheduler_stanza(objects: list[dict[str, Any]], url: str) -> dict[str, Any]:
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].endswith("-scheduler-config")]
    (stanza,) = yaml.safe_load(cm["data"]["scheduler-config.yaml"])["extenders"]
    return {**stanza, "urlPrefix": url}


def _shared_node(cp: ControlPlane, name: str) -> None:
    """A node whose plugin shares GPUs 0-3 as 4 replicas each of nvidia.com/gpu.shared (the config above) and
    offers GPUs 4-7 whole, as the plugin publishes it (topology and state annotations) and the kubelet advertises."""
    topo = load_topology_file(A100)
    ids = topo.ids
    replicas = tuple(SharedGpu(ids[i], 4, 0) for i in range(4))
    sharing = Sharing("time-slicing", False, (SharedResource(SHARED, replicas),))
    state = state_to_json(NodeState(1, frozenset(), frozenset(), sharing))
    cp.add_node(name, annotations={DEFAULT_KEYS.topology: topology_to_json(topo), DEFAULT_KEYS.state: state},
                extended={GPU: "4", SHARED: "16"})


def _pod(name: str, scheduler: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"terminationGracePeriodSeconds": 0, "containers": [{
        "name": "infer", "image": "registry.invalid/none:0",
        "resources": {"limits": {SHARED: "2"}, "requests": {SHARED: "2"}}}]}
    if scheduler is not None:
        spec["schedulerName"] = scheduler
    return {"metadata": {"name": name}, "spec": spec}


def _bound(cp: ControlPlane, name: str) -> dict[str, Any]:
    deadline = time.monotonic() + WAIT_S
    pod: dict[str, Any] = {}
    while time.monotonic() < deadline:
        pod = cp.request("GET", f"/api/v1/namespaces/{NS}/pods/{name}")
        if pod["spec"].get("nodeName"):
            return pod
        time.sleep(0.2)
    why = [c.get("message") for c in pod.get("status", {}).get("conditions", [])]
    pytest.fail(f"{name} not bound after {WAIT_S} s (schedulerName {pod['spec'].get('schedulerName')!r}): {why}")


@pytest.fixture(scope="module")
def cluster(real_control_plane: ControlPlane) -> Iterator[tuple[ControlPlane, dict[str, str]]]:
    objects = _chart()
    with tidied(real_control_plane) as cp:
        cp.ensure_namespace(NS)
        _shared_node(cp, "shared-0")
        extender = cp.start_extender()
        url = extender.url
        stanza = _scheduler_stanza(objects, url)
        profile = {"percentageOfNodesToScore": 100}
        cp.start_scheduler([stanza], name=SCHEDULER,
                           extra_config={"profiles": [{"schedulerName": SCHEDULER, **profile}]})
        before = {**stanza, "managedResources": [m for m in stanza["managedResources"]
                                                 if not m["name"].endswith(".shared")]}
        cp.start_scheduler([before], name=BEFORE, extra_config={"profiles": [{"schedulerName": BEFORE, **profile}]})
        (hook_config,) = [o for o in objects if o["kind"] == "MutatingWebhookConfiguration"]
        (hook,) = hook_config["webhooks"]
        (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-webhook")]
        args = [a for a in deployment["spec"]["template"]["spec"]["containers"][0]["args"][1:]
                if a.split("=", 1)[0] in ("--scheduler-name", "--resource-name", "--annotation-prefix",
                                          "--extra-resources", "--whole-jobs")]
        start_webhook(cp, hook, *args)
        yield cp, {"extender": str(extender.proc.log)}


@pytest.mark.parametrize("scheduler", [None, SCHEDULER], ids=["via-the-webhook", "named"])
def test_a_pod_asking_the_renamed_shared_resource_is_planned_by_the_extender(
        cluster: tuple[ControlPlane, dict[str, str]], scheduler: str | None) -> None:
    cp, logs = cluster
    name = f"infer-{'webhook' if scheduler is None else 'named'}"
    cp.request("POST", f"/api/v1/namespaces/{NS}/pods", _pod(name, scheduler))
    pod = _bound(cp, name)
    assert pod["spec"]["schedulerName"] == SCHEDULER
    ann = pod["metadata"].get("annotations") or {}
    assert DEFAULT_KEYS.plan in ann, f"bound without the extender: {ann}; extender log: {logs['extender']}"
    placement = ann.get(DEFAULT_KEYS.placement, "")
    assert f"replicas of {SHARED}" in placement and "distinct GPUs" in placement, placement
    # two replicas on two distinct GPUs: the rule kube-scheduler alone cannot keep
    plan = parse_plan(ann[DEFAULT_KEYS.plan])
    ids = [i for c in plan.container_ids().values() for i in c]
    assert plan.resource == SHARED and len(ids) == len(set(ids)) == 2, ann[DEFAULT_KEYS.plan]


def test_without_the_shared_names_kube_scheduler_binds_the_pod_by_itself(
        cluster: tuple[ControlPlane, dict[str, str]]) -> None:
    """The control, configured as the chart was before the fix: the real kube-scheduler binds the pod itself, without
    asking the extender (no plan, no explanation), so the test above tells the two configurations apart."""
    cp, _ = cluster
    cp.request("POST", f"/api/v1/namespaces/{NS}/pods", _pod("infer-before", BEFORE))
    pod = _bound(cp, "infer-before")
    ann = pod["metadata"].get("annotations") or {}
    assert DEFAULT_KEYS.plan not in ann and DEFAULT_KEYS.placement not in ann, ann
