"""Every ResourceClaimTemplate of deploy/dra/claim-templates.yaml is allocated by the real kube-scheduler v1.36.2's
DRA allocator (tests/helpers/controlplane.py, with kube-controller-manager making each pod's claim from its
template), against the slices our driver publishes (gpuplugin.dra: whole GPUs and GPU sets on three HGX A100
nodes; shared GPUs and MIG instances on an H100 node in mixed MIG mode with time-slicing on two GPUs, 8 replicas
each, room for every share template at once) and the DeviceClasses of deploy/dra/deviceclasses.yaml. A template the
allocator cannot satisfy leaves its pod Pending, which no fake shows: the fake apiserver does not allocate, and the
simulator's allocator reads no capacity at all.

Skips, naming why, where the Kubernetes binaries (shared/kube beside the clone) or etcd are absent."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from gpuplugin.dra.catalog import Catalog
from gpuplugin.dra.partitions import gpus_to_share, mig_devices, shared_devices
from gpuplugin.dra.pool import PoolPlanner
from gpuplugin.dra.slices import slice_name, slice_object
from gpuplugin.sharing.config import parse_config
from gpuplugin.sharing.layout import resolve
from gputopo.discovery.nvml import discover_node
from gputopo.discovery.recording import replay_backend
from tests.fixtures.nvml import RECORDINGS, load_json
from tests.helpers.controlplane import ControlPlane, tidied
from tests.helpers.paths import REPO

pytestmark = [pytest.mark.timeout(300)]

DRIVER = "gpu-topology.io"
TAINT = f"{DRIVER}/unhealthy"
DRA = "/apis/resource.k8s.io/v1"
NAMESPACE = "dra-templates"
WHOLE = RECORDINGS / "synthetic-hgx-a100-8gpu-nvswitch.json"
MIXED = RECORDINGS / "synthetic-hgx-h100-80gb-8gpu-mig-mixed.json"
SHARING = """version: v1
sharing:
  timeSlicing:
    resources:
      - name: nvidia.com/gpu
        rename: nvidia.com/gpu.shared
        replicas: 8
        devices: [0, 1]
"""
WAIT_S = 60.0  # liveness bound of one allocation on a loaded 2-core machine, never a performance figure


def _templates() -> list[dict[str, Any]]:
    return [t for t in yaml.safe_load_all((REPO / "deploy" / "dra" / "claim-templates.yaml").read_text()) if t]


def _publish(cp: ControlPlane, node: str, catalog: Catalog) -> None:
    cp.add_node(node, labels={f"{DRIVER}/gpu-mode": "dra"})
    contents = PoolPlanner(catalog, taint_key=TAINT).wanted()
    for i, content in enumerate(contents):
        body = slice_object(content, driver=DRIVER, node=node, generation=1, count=len(contents))
        body["metadata"] = {"name": slice_name(i, DRIVER, node)}
        cp.request("POST", f"{DRA}/resourceslices", body)


@pytest.fixture(scope="module")
def cluster(real_control_plane: ControlPlane) -> Iterator[ControlPlane]:
    with tidied(real_control_plane) as cp:
        whole = Catalog.build(discover_node(replay_backend(load_json(WHOLE))).topology)
        for n in range(3):
            _publish(cp, f"whole-{n}", whole)
        found = discover_node(replay_backend(load_json(MIXED)))  # 4 whole GPUs, 4 in MIG mode
        layout = resolve(parse_config(SHARING), found.topology, "nvidia.com/gpu")
        to_share, _ = gpus_to_share(layout, ())
        shared = [d for d in shared_devices(found.topology, layout) if d.gpus[0] in to_share]
        migs, _ = mig_devices(found.mig)
        _publish(cp, "shared-mig", Catalog.build(found.topology, exclude=to_share, extra=[*shared, *migs]))
        for dc in yaml.safe_load_all((REPO / "deploy" / "dra" / "deviceclasses.yaml").read_text()):
            if dc:
                cp.request("POST", f"{DRA}/deviceclasses", dc)
        cp.ensure_namespace(NAMESPACE)
        for template in _templates():
            cp.request("POST", f"{DRA}/namespaces/{NAMESPACE}/resourceclaimtemplates", template)
        sched = cp.start_scheduler()
        try:
            yield cp
        finally:
            cp.stop_scheduler(sched)


def _pod(template: str) -> dict[str, Any]:
    return {"metadata": {"name": f"uses-{template}"},
            "spec": {"resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template}],
                     "containers": [{"name": "main", "image": "registry.invalid/none:0",
                                     "resources": {"claims": [{"name": "gpus"}]}}],
                     "terminationGracePeriodSeconds": 0}}


def _scheduled(cp: ControlPlane, name: str) -> tuple[str | None, str]:
    pod = cp.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
    why = next((c.get("message", "") for c in pod.get("status", {}).get("conditions", [])
                if c.get("type") == "PodScheduled" and c.get("status") == "False"), "")
    return pod["spec"].get("nodeName"), why


@pytest.mark.parametrize("template", [t["metadata"]["name"] for t in _templates()])
def test_the_template_is_allocated_by_the_real_scheduler(cluster: ControlPlane, template: str) -> None:
    cluster.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", _pod(template))
    deadline = time.monotonic() + WAIT_S
    node, why = None, ""
    while node is None and time.monotonic() < deadline:
        node, why = _scheduled(cluster, f"uses-{template}")
        time.sleep(0.2)
    if node is None:
        claims = [(c["metadata"]["name"], c.get("status")) for c in
                  cluster.list_items(f"{DRA}/namespaces/{NAMESPACE}/resourceclaims")]
        logs = "".join(p.log_tail(2500) for p in cluster.procs if p.name == "kube-controller-manager")
        pytest.fail(f"{template}: never scheduled: {why or 'no PodScheduled condition'}; claims {claims}; "
                    f"kube-controller-manager: {logs}")
    claims = [c for c in cluster.list_items(f"{DRA}/namespaces/{NAMESPACE}/resourceclaims")
              if any(o.get("name") == f"uses-{template}" for o in c["metadata"].get("ownerReferences", []))]
    (claim,) = claims
    results = claim["status"]["allocation"]["devices"]["results"]
    assert results and all(r["driver"] == DRIVER and r["pool"] == node for r in results), results
    if template.startswith(("gpu-share", "gpu-three", "mig-")):
        assert node == "shared-mig", (template, node)  # the only node with shared GPUs and MIG instances
    if template == "gpu-three-shares":
        assert [(r.get("consumedCapacity") or {}).get("replicas") for r in results] == ["3"], results


def _kubectl_apply(cp: ControlPlane, documents: list[dict[str, Any]]) -> None:
    done = subprocess.run([str(cp.bin / "kubectl"), f"--kubeconfig={cp.kubeconfig}", "apply", "-f", "-"],
                          input=yaml.safe_dump_all(documents), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def _printed_slices(node: str, *args: str) -> list[dict[str, Any]]:
    out = subprocess.run([sys.executable, "-m", "gpuplugin.cli", "slices", "--topology", str(WHOLE),
                          "--node-name", node, *args], capture_output=True, text=True, timeout=60, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def test_printed_slices_applied_one_at_a_time_never_make_the_pool_invalid(cluster: ControlPlane) -> None:
    """`gpuplugin slices` for a new state, applied slice by slice over the old one: the slice applied first lists a
    GPU set that an old slice still lists. At one generation the pool is invalid and the scheduler fails the pod
    with "invalid resource pools"; the printed generation outranks the old one, so the pool is only incomplete
    for the moment and the pod lands once every slice is in."""
    node = "handmade"
    cluster.add_node(node, labels={f"{DRIVER}/gpu-mode": "dra"})
    old = _printed_slices(node, "--generation", "1")
    _kubectl_apply(cluster, old)
    new = _printed_slices(node, "--allocated", "gpu-5")  # moves four GPU sets to another slice
    old_sets = {d["metadata"]["name"]: {x["name"] for x in d["spec"].get("devices", [])} for d in old}
    first = next(d for d in new if any(x["name"] in names for x in d["spec"].get("devices", [])
                                       for other, names in old_sets.items() if other != d["metadata"]["name"]))
    _kubectl_apply(cluster, [first])
    pod = _pod("best-4-gpus")
    pod["metadata"]["name"] = "uses-hand-applied"
    pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": node}
    cluster.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", pod)
    time.sleep(3.0)  # long enough for the scheduler to try the pod against the half-applied pool
    placed, why = _scheduled(cluster, "uses-hand-applied")
    assert "invalid" not in why, why
    _kubectl_apply(cluster, [d for d in new if d is not first])
    deadline = time.monotonic() + WAIT_S
    while placed is None and time.monotonic() < deadline:
        placed, why = _scheduled(cluster, "uses-hand-applied")
        time.sleep(0.2)
    assert placed == node, why
