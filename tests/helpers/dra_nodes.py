"""DRA nodes on a real control plane (tests/helpers/controlplane.py) for the best-node test and bench.dra_nodes:
a Node per topology with our driver's pool published as the driver would (gpuplugin.dra), the DeviceClasses and
claim templates of deploy/dra/, pods asking through a template or `nvidia.com/gpu: N`, and the two extender stanzas
that rank DRA nodes (the chart's, deploy/helm/gpu-topology/templates/scheduler-config.yaml with dra.enabled)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from gpuplugin.dra.catalog import Catalog
from gpuplugin.dra.pool import PoolPlanner
from gpuplugin.dra.slices import slice_name, slice_object
from gputopo.core import Topology
from tests.helpers.controlplane import GPU, ControlPlane, extender_stanza
from tests.helpers.paths import REPO

DRIVER = "gpu-topology.io"
TAINT = f"{DRIVER}/unhealthy"
DRA = "/apis/resource.k8s.io/v1"


def templates() -> list[dict[str, Any]]:
    return [t for t in yaml.safe_load_all((REPO / "deploy" / "dra" / "claim-templates.yaml").read_text()) if t]


def install_classes(cp: ControlPlane, namespace: str) -> None:
    """deploy/dra's DeviceClasses (gpu.gpu-topology.io maps nvidia.com/gpu) and its claim templates in
    `namespace`."""
    for dc in yaml.safe_load_all((REPO / "deploy" / "dra" / "deviceclasses.yaml").read_text()):
        if dc:
            cp.request("POST", f"{DRA}/deviceclasses", dc, ok=(201, 409))
    cp.ensure_namespace(namespace)
    for template in templates():
        cp.request("POST", f"{DRA}/namespaces/{namespace}/resourceclaimtemplates", template, ok=(201, 409))


def add_dra_node(cp: ControlPlane, node: str, topology: Topology, *, used: set[int] | frozenset[int] = frozenset(),
                 publish: bool = True) -> Catalog:
    """A Node labelled for DRA (no nvidia.com/gpu allocatable: the device plugin skips it) and, with `publish`, its
    pool as the driver publishes it for `used` GPUs (one generation, fixed slice names)."""
    cp.add_node(node, labels={f"{DRIVER}/gpu-mode": "dra"})
    catalog = Catalog.build(topology)
    if publish:
        contents = PoolPlanner(catalog, taint_key=TAINT).wanted(used)
        for i, content in enumerate(contents):
            body = slice_object(content, driver=DRIVER, node=node, generation=1, count=len(contents))
            body["metadata"] = {"name": slice_name(i, DRIVER, node)}
            cp.request("POST", f"{DRA}/resourceslices", body)
    return catalog


def template_pod(name: str, size: int) -> dict[str, Any]:
    """A pod using the "best <size> GPUs" template ("one-gpu" for one)."""
    template = "one-gpu" if size == 1 else f"best-{size}-gpus"
    return {"metadata": {"name": name},
            "spec": {"resourceClaims": [{"name": "gpus", "resourceClaimTemplateName": template}],
                     "containers": [{"name": "main", "image": "registry.invalid/none:0",
                                     "resources": {"claims": [{"name": "gpus"}]}}],
                     "terminationGracePeriodSeconds": 0}}


def plain_pod(name: str, size: int) -> dict[str, Any]:
    """A pod asking `nvidia.com/gpu: <size>`, unchanged (served through the DeviceClass's extendedResourceName)."""
    return {"metadata": {"name": name},
            "spec": {"containers": [{"name": "main", "image": "registry.invalid/none:0",
                                     "resources": {"limits": {GPU: str(size)}}}],
                     "terminationGracePeriodSeconds": 0}}


def dra_stanzas(url: str, *, filter_best: bool = False, weight: int = 5) -> list[dict[str, Any]]:
    """The extender entries of a scheduler that ranks DRA nodes: the chart's GPU entry (binder, managedResources
    nvidia.com/gpu: also the pods asking nvidia.com/gpu on DRA nodes) and the DRA entry (no managedResources, so
    pods with claims reach it too; no bind; ignorable)."""
    main = extender_stanza(url, weight=weight)
    dra: dict[str, Any] = {"urlPrefix": url, "filterVerb": "filter", "nodeCacheCapable": True,
                           "enableHTTPS": False, "httpTimeout": "5s", "ignorable": True}
    if filter_best:
        main.pop("prioritizeVerb")
        main.pop("weight")
    else:
        dra.update(prioritizeVerb="prioritize", weight=weight)
    return [main, dra]


def claim_of(cp: ControlPlane, namespace: str, pod: str) -> dict[str, Any] | None:
    """The claim a pod got (from its template, or the scheduler's extended-resource claim), by owner."""
    for c in cp.list_items(f"{DRA}/namespaces/{namespace}/resourceclaims"):
        if any(o.get("name") == pod for o in c["metadata"].get("ownerReferences", [])):
            return c
    return None


def allocated_gpus(claim: Mapping[str, Any]) -> tuple[str, tuple[int, ...]] | None:
    """(node, GPUs) of a claim's allocation of our devices, or None while unallocated."""
    from gputopo.contract import parse_dra_device

    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
    ours = [r for r in results if r.get("driver") == DRIVER]
    if not ours:
        return None
    gpus: set[int] = set()
    for r in ours:
        parsed = parse_dra_device(r["device"])
        if parsed is not None:
            gpus.update(parsed[1])
    return ours[0]["pool"], tuple(sorted(gpus))
