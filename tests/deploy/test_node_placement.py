"""Safe by default beside NVIDIA's plugin: which nodes the chart's and the manifests' node agents (device plugin,
MPS control, DRA driver) go to, evaluated with the API server's node-affinity semantics (tests/deploy/node_matching.py)
against the labels real nodes carry. A default install next to the GPU Operator starts nothing; a node moved over
(the Operator's plugin removed, ours opted in) gets ours; a node opted in while the Operator still deploys its own
plugin does not."""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

import pytest

from tests.deploy.node_matching import pod_fits_node, runs_on
from tests.deploy.rendering import CHART_VARIANTS, MANIFESTS, ChartVariant, find, kustomize_build, render_chart

# The labels the GPU Operator (and its GPU Feature Discovery / Node Feature Discovery) puts on a GPU node.
OPERATOR_NODE = {
    "kubernetes.io/hostname": "gpu-1",
    "kubernetes.io/os": "linux",
    "feature.node.kubernetes.io/pci-10de.present": "true",
    "nvidia.com/gpu.present": "true",
    "nvidia.com/gpu.count": "8",
    "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3",
    "nvidia.com/gpu.deploy.driver": "true",
    "nvidia.com/gpu.deploy.container-toolkit": "true",
    "nvidia.com/gpu.deploy.device-plugin": "true",
    "nvidia.com/gpu.deploy.gpu-feature-discovery": "true",
    "nvidia.com/gpu.deploy.dcgm": "true",
    "nvidia.com/gpu.deploy.dcgm-exporter": "true",
    "nvidia.com/gpu.deploy.node-status-exporter": "true",
    "nvidia.com/gpu.deploy.operator-validator": "true",
}
# Moved over: `kubectl label node NODE nvidia.com/gpu.deploy.device-plugin=false --overwrite` (the Operator removes
# its plugin) and `kubectl label node NODE gpu-topology.io/device-plugin=enabled`.
MOVED = {**OPERATOR_NODE, "nvidia.com/gpu.deploy.device-plugin": "false", "gpu-topology.io/device-plugin": "enabled"}
# Opted in, but the Operator still deploys its device plugin there.
OPTED_IN_ONLY = {**OPERATOR_NODE, "gpu-topology.io/device-plugin": "enabled"}
PLAIN_GPU = {"kubernetes.io/hostname": "gpu-2", "nvidia.com/gpu.present": "true"}
NFD_GPU = {"kubernetes.io/hostname": "gpu-3", "feature.node.kubernetes.io/pci-10de.present": "true"}
CPU_NODE = {"kubernetes.io/hostname": "cpu-1", "kubernetes.io/os": "linux"}
DRA = {"gpu-topology.io/gpu-mode": "dra"}

MPS_CONFIG = "version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 4}\n"
# Every node agent the chart can render: plugin, MPS control daemon set, DRA driver.
EVERY_AGENT = {"plugin": {"sharing": {"enabled": True, "configs": {"mps": MPS_CONFIG}}}, "dra": {"enabled": True}}


def _daemonsets(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return copy.deepcopy(_rendered(json.dumps(values, sort_keys=True)))


@functools.cache
def _rendered(values: str) -> dict[str, dict[str, Any]]:
    objects = render_chart(ChartVariant("gpu-topology", "gpu-topology", json.loads(values)))
    return {d["metadata"]["name"].removeprefix("gpu-topology-"): d for d in find(objects, "DaemonSet")}


def _placed(values: dict[str, Any], labels: dict[str, str]) -> set[str]:
    return {name for name, ds in _daemonsets(values).items() if runs_on(ds, labels)}


# ---------------------------------------------------------------------------------------------------------------
# the matcher itself: it must say yes and no


@pytest.mark.parametrize(("expression", "labels", "fits"), [
    ({"key": "a", "operator": "In", "values": ["x", "y"]}, {"a": "y"}, True),
    ({"key": "a", "operator": "In", "values": ["x"]}, {"a": "y"}, False),
    ({"key": "a", "operator": "In", "values": ["x"]}, {}, False),
    ({"key": "a", "operator": "NotIn", "values": ["x"]}, {}, True),
    ({"key": "a", "operator": "NotIn", "values": ["x"]}, {"a": "y"}, True),
    ({"key": "a", "operator": "NotIn", "values": ["x"]}, {"a": "x"}, False),
    ({"key": "a", "operator": "Exists"}, {"a": ""}, True),
    ({"key": "a", "operator": "Exists"}, {"b": "x"}, False),
    ({"key": "a", "operator": "DoesNotExist"}, {"b": "x"}, True),
    ({"key": "a", "operator": "DoesNotExist"}, {"a": "x"}, False),
    ({"key": "a", "operator": "Gt", "values": ["4"]}, {"a": "8"}, True),
    ({"key": "a", "operator": "Gt", "values": ["4"]}, {"a": "4"}, False),
    ({"key": "a", "operator": "Lt", "values": ["4"]}, {"a": "2"}, True),
    ({"key": "a", "operator": "Lt", "values": ["4"]}, {"a": "x"}, False),
])
def test_matcher_operators(expression: dict[str, Any], labels: dict[str, str], fits: bool) -> None:
    pod = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [expression]}]}}}}
    assert pod_fits_node(pod, labels) is fits


def test_matcher_terms_are_ored_expressions_anded_and_empty_matches_nothing() -> None:
    def pod(*terms: dict[str, Any], selector: dict[str, str] | None = None) -> dict[str, Any]:
        spec: dict[str, Any] = {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": list(terms)}}}}
        if selector is not None:
            spec["nodeSelector"] = selector
        return spec

    a = {"key": "a", "operator": "In", "values": ["1"]}
    b = {"key": "b", "operator": "In", "values": ["1"]}
    assert pod_fits_node(pod({"matchExpressions": [a]}, {"matchExpressions": [b]}), {"b": "1"})
    assert not pod_fits_node(pod({"matchExpressions": [a, b]}), {"b": "1"})
    assert pod_fits_node(pod({"matchExpressions": [a, b]}), {"a": "1", "b": "1"})
    assert not pod_fits_node(pod(), {"a": "1"}), "no terms: no node"
    assert not pod_fits_node(pod({"matchExpressions": []}), {"a": "1"}), "an empty term matches no node"
    assert not pod_fits_node(pod({"matchExpressions": [a]}, selector={"c": "1"}), {"a": "1"}), "nodeSelector ANDed"
    assert pod_fits_node(pod({"matchExpressions": [a]}, selector={"c": "1"}), {"a": "1", "c": "1"})
    assert pod_fits_node({}, {}), "no constraint: every node"
    fields = {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}
    assert pod_fits_node(pod(fields), {}, "n1") and not pod_fits_node(pod(fields), {}, "n2")


# ---------------------------------------------------------------------------------------------------------------
# the chart


def test_every_agent_is_rendered_for_these_tests() -> None:
    assert set(_daemonsets(EVERY_AGENT)) == {"plugin", "mps-control", "dra"}
    assert set(_daemonsets({})) == {"plugin"}


@pytest.mark.parametrize("values", [{}, EVERY_AGENT], ids=["defaults", "every-agent"])
@pytest.mark.parametrize("node", [OPERATOR_NODE, {**OPERATOR_NODE, **DRA}, OPTED_IN_ONLY, {**OPTED_IN_ONLY, **DRA},
                                  PLAIN_GPU, NFD_GPU, CPU_NODE],
                         ids=["operator", "operator-dra", "opted-in-operator-plugin", "opted-in-operator-plugin-dra",
                              "plain-gpu", "nfd-gpu", "cpu"])
def test_default_install_beside_the_gpu_operator_starts_nothing(values: dict[str, Any], node: dict[str, str]) -> None:
    """(1) the GPU Operator's nodes, (3) opted in while the Operator still deploys its plugin, and any node not opted
    in: no node agent of ours."""
    assert _placed(values, node) == set()


def test_a_node_moved_over_gets_the_plugin() -> None:
    """(2) nvidia.com/gpu.deploy.device-plugin=false + gpu-topology.io/device-plugin=enabled."""
    assert _placed({}, MOVED) == {"plugin"}
    assert _placed(EVERY_AGENT, MOVED) == {"plugin", "mps-control"}
    assert _placed(EVERY_AGENT, {**MOVED, **DRA}) == {"dra"}, "DRA nodes: the driver, not the device plugin"
    # Only the opt-in label is needed where no Operator runs (no nvidia.com/gpu.deploy.* labels at all).
    assert _placed(EVERY_AGENT, {**CPU_NODE, "gpu-topology.io/device-plugin": "enabled"}) == {"plugin", "mps-control"}
    assert _placed({}, {**MOVED, "gpu-topology.io/device-plugin": "nvidia"}) == set()


def test_opt_out_mode_runs_on_gpu_nodes_but_never_beside_nvidias_plugin() -> None:
    """(4) plugin.optIn=false: every GPU node, except those labelled nvidia or where the Operator deploys its own."""
    values = copy.deepcopy(EVERY_AGENT)
    values["plugin"]["optIn"] = False
    assert _placed(values, PLAIN_GPU) == {"plugin", "mps-control"}
    assert _placed(values, NFD_GPU) == {"plugin", "mps-control"}
    assert _placed(values, {**PLAIN_GPU, "gpu-topology.io/device-plugin": "nvidia"}) == set()
    assert _placed(values, OPERATOR_NODE) == set()
    assert _placed(values, {**OPERATOR_NODE, "nvidia.com/gpu.deploy.device-plugin": "false"}) == {"plugin",
                                                                                                  "mps-control"}
    assert _placed(values, {**PLAIN_GPU, **DRA}) == {"dra"}
    assert _placed(values, CPU_NODE) == set()


def test_own_prefix_and_user_affinity_keep_the_guards() -> None:
    prefix = {"annotationPrefix": "topo.acme.example"}
    assert _placed(prefix, MOVED) == set(), "the label follows annotationPrefix"
    assert _placed(prefix, {**MOVED, "topo.acme.example/device-plugin": "enabled"}) == {"plugin"}
    pool = {"key": "acme.example/pool", "operator": "In", "values": ["training"]}
    preferred = [{"weight": 1, "preference": {"matchExpressions": [pool]}}]
    values = {"plugin": {"affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [pool]}]},
        "preferredDuringSchedulingIgnoredDuringExecution": preferred}}}}
    training = {"acme.example/pool": "training"}
    assert _placed(values, {**MOVED, **training}) == {"plugin"}
    assert _placed(values, MOVED) == set(), "the user's term applies"
    assert _placed(values, {**OPTED_IN_ONLY, **training}) == set(), "the Operator guard is added to the user's term"
    assert _placed(values, {**OPERATOR_NODE, **training, "nvidia.com/gpu.deploy.device-plugin": "false"}) == set()
    affinity = _daemonsets(values)["plugin"]["spec"]["template"]["spec"]["affinity"]
    assert affinity["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == preferred


# ---------------------------------------------------------------------------------------------------------------
# the kustomize manifests


def test_manifests_plugin_is_opt_in_too() -> None:
    (plugin,) = find(kustomize_build(MANIFESTS), "DaemonSet")
    assert not runs_on(plugin, OPERATOR_NODE)
    assert not runs_on(plugin, OPTED_IN_ONLY)
    assert not runs_on(plugin, PLAIN_GPU)
    assert runs_on(plugin, MOVED)
    (chart,) = find(render_chart(CHART_VARIANTS["defaults"]), "DaemonSet")
    assert plugin["spec"]["template"]["spec"]["affinity"] == chart["spec"]["template"]["spec"]["affinity"]
