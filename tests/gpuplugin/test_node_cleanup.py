"""What the plugin takes off its Node (gpuplugin.node_cleanup): its own keys only, and only when the node opted out.
Against the real kube-apiserver: tests/integration/test_uninstall_cleanup_real.py."""

from __future__ import annotations

from typing import Any

import pytest

from gpuplugin.autoscaler_hold import HOLD_ANNOTATIONS, HOLD_VALUE
from gpuplugin.node_cleanup import owned_on, pod_fits_node
from gputopo.contract import CA_SCALE_DOWN_DISABLED, DEFAULT_KEYS, KARPENTER_DO_NOT_DISRUPT, Keys

K = DEFAULT_KEYS


def node(labels: dict[str, str] | None = None, annotations: dict[str, str] | None = None,
         name: str = "n1") -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {}, "annotations": annotations or {}}}


def pod(terms: list[dict[str, Any]] | None = None, selector: dict[str, str] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"nodeSelector": selector} if selector else {}
    if terms is not None:
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": terms}}}
    return {"spec": spec}


OPT_IN = {"key": K.device_plugin_label, "operator": "In", "values": ["enabled"]}
NOT_OPERATOR = {"key": "nvidia.com/gpu.deploy.device-plugin", "operator": "NotIn", "values": ["true"]}
THIS_NODE = {"key": "metadata.name", "operator": "In", "values": ["n1"]}


def test_owned_keys_are_the_plugins_only() -> None:
    labels = {K.fabric_label: "nvswitch", K.model_label: "H100", K.count_label: "8", K.allreduce_label(2): "300",
              K.allreduce_label(8): "200", str(K.free_gpus_label("nvidia.com/gpu.shared")): "3",
              K.device_plugin_label: "enabled", "nvidia.com/gpu.product": "H100", "example.com/rack": "r1",
              K._key("allreduce-gbps-x"): "1"}
    annotations = {K.topology: "{}", K.state: "{}", K.autoscaler_hold: ",".join(HOLD_ANNOTATIONS),
                   CA_SCALE_DOWN_DISABLED: HOLD_VALUE, KARPENTER_DO_NOT_DISRUPT: "ops", "example.com/x": "y",
                   K.plan: "not on a node, but never ours to remove from one"}
    removal = owned_on(node(labels, annotations), K)
    assert set(removal.labels) == {K.fabric_label, K.model_label, K.count_label, K.allreduce_label(2),
                                   K.allreduce_label(8), str(K.free_gpus_label("nvidia.com/gpu.shared"))}
    # Karpenter's hold was changed by someone since: theirs now
    assert set(removal.annotations) == {K.topology, K.state, K.autoscaler_hold, CA_SCALE_DOWN_DISABLED}
    assert "nvidia.com/gpu.product" in owned_on(node(labels, annotations), K, gfd_labels=True).labels


def test_gfd_labels_are_never_removed_from_a_node_gfd_labels() -> None:
    """The uninstall hook asks for them (gfdLabels auto or on); where GFD stamps the node they are GFD's."""
    gfd = {"nvidia.com/gpu.product": "H100", "nvidia.com/gpu.replicas": "1", "nvidia.com/gfd.timestamp": "1765000000",
           K.fabric_label: "nvswitch"}
    assert set(owned_on(node(gfd), K, gfd_labels=True).labels) == {K.fabric_label}


def test_a_hold_not_listed_as_ours_stays() -> None:
    annotations = {CA_SCALE_DOWN_DISABLED: HOLD_VALUE, KARPENTER_DO_NOT_DISRUPT: HOLD_VALUE}
    assert not owned_on(node(annotations=annotations), K)


def test_another_prefix_is_another_products_keys() -> None:
    other = Keys("topo.acme.example")
    assert not owned_on(node({K.fabric_label: "pcie"}, {K.state: "{}"}), other)


@pytest.mark.parametrize(("labels", "fits"), [
    ({K.device_plugin_label: "enabled"}, True),
    ({}, False),  # opt-in label removed
    ({K.device_plugin_label: "nvidia"}, False),
    ({K.device_plugin_label: "enabled", "nvidia.com/gpu.deploy.device-plugin": "true"}, False),  # the Operator's
])
def test_the_daemonset_pods_affinity_decides_opt_out(labels: dict[str, str], fits: bool) -> None:
    plugin = pod([{"matchExpressions": [OPT_IN, NOT_OPERATOR], "matchFields": [THIS_NODE]}])
    assert pod_fits_node(plugin, node(labels)) is fits


def test_opt_out_mode_and_other_operators() -> None:
    # plugin.optIn false: every GPU node not labelled <prefix>/device-plugin=nvidia (two alternatives)
    not_nvidia = {"key": K.device_plugin_label, "operator": "NotIn", "values": ["nvidia"]}
    terms = [{"matchExpressions": [{"key": k, "operator": "In", "values": ["true"]}, not_nvidia]}
             for k in ("nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present")]
    assert pod_fits_node(pod(terms), node({"feature.node.kubernetes.io/pci-10de.present": "true"}))
    assert not pod_fits_node(pod(terms), node({"nvidia.com/gpu.present": "true", K.device_plugin_label: "nvidia"}))
    exists = [{"matchExpressions": [{"key": "a", "operator": "Exists"}, {"key": "b", "operator": "DoesNotExist"},
                                    {"key": "n", "operator": "Gt", "values": ["3"]}]}]
    assert pod_fits_node(pod(exists), node({"a": "", "n": "4"}))
    assert not pod_fits_node(pod(exists), node({"a": "", "n": "3"}))
    assert not pod_fits_node(pod(exists), node({"a": "", "b": "", "n": "4"}))


def test_node_selector_and_no_affinity() -> None:
    assert pod_fits_node(pod(), node())
    assert pod_fits_node(pod(selector={"pool": "gpu"}), node({"pool": "gpu"}))
    assert not pod_fits_node(pod(selector={"pool": "gpu"}), node({"pool": "cpu"}))
    assert not pod_fits_node(pod([{"matchFields": [THIS_NODE]}]), node(name="n2"))
    assert not pod_fits_node(pod([{}]), node())  # an empty term selects no node
