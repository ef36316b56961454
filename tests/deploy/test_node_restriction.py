"""Every install that gives the node agents their cluster-wide writes also installs the policies that narrow them
to the agent's own node (tests/integration/test_node_restriction_real.py shows the real kube-apiserver enforcing
them): the plugin's `nodes patch` and the DRA driver's ResourceSlice writes are matched by exactly their accounts
(never the uninstall hook's), with the chart's prefix and driver name, and the manifests carry the chart's policy."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.deploy.rendering import (
    MANIFESTS,
    ChartVariant,
    Obj,
    all_renderings,
    find,
    kustomize_build,
    render_chart,
    rendering_names,
)

GFD = ("nvidia.com/gpu.replicas", "nvidia.com/gpu.sharing-strategy", "nvidia.com/gpu.product",
       "nvidia.com/mps.capable")
SHARING = {"enabled": True, "configs": {"slicing": "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
                                                   "    - {name: nvidia.com/gpu, replicas: 2}\n"}}


def _render(values: dict[str, Any], release: str = "gpu-topology", namespace: str = "gpu-topology") -> list[Obj]:
    return render_chart(ChartVariant(release, namespace, copy.deepcopy(values)))


def _policy_for(objects: list[Obj], account: Obj, resource: str) -> Obj:
    """The one bound Deny policy on `resource` whose match condition names `account`."""
    user = f"system:serviceaccount:{account['metadata']['namespace']}:{account['metadata']['name']}"
    found = [p for p in find(objects, "ValidatingAdmissionPolicy")
             if any(resource in r["resources"] for r in p["spec"]["matchConstraints"]["resourceRules"])
             and any(f"'{user}'" in c["expression"] for c in p["spec"].get("matchConditions", []))]
    assert len(found) == 1, f"{user}: {len(found)} policies on {resource}"
    (policy,) = found
    bindings = [b for b in find(objects, "ValidatingAdmissionPolicyBinding")
                if b["spec"]["policyName"] == policy["metadata"]["name"]]
    assert [b["spec"]["validationActions"] for b in bindings] == [["Deny"]]
    assert policy["spec"]["failurePolicy"] == "Fail"
    return policy


def _text(policy: Obj) -> str:
    """Everything the policy evaluates, whitespace-normalised (folded YAML lines)."""
    spec = policy["spec"]
    parts = [v["expression"] for v in spec["variables"]] + [v["expression"] for v in spec["validations"]]
    return " ".join(" ".join(parts).split())


@pytest.mark.parametrize("rendering", rendering_names())
def test_each_node_agent_account_comes_with_its_node_policy(rendering: str) -> None:
    objects = all_renderings()[rendering]
    for account in find(objects, "ServiceAccount"):
        component = account["metadata"]["labels"]["app.kubernetes.io/component"]
        if component == "device-plugin":
            policy = _policy_for(objects, account, "nodes")
            (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
            assert rule["operations"] == ["UPDATE"] and rule["apiGroups"] == [""]
        elif component == "dra-driver":
            _policy_for(objects, account, "resourceslices")


def test_the_dra_drivers_policy_follows_the_driver_and_release() -> None:
    objects = _render({"dra": {"enabled": True, "driverName": "gpu.acme.example"}}, "prod", "gpu-system")
    (account,) = [a for a in find(objects, "ServiceAccount")
                  if a["metadata"]["labels"]["app.kubernetes.io/component"] == "dra-driver"]
    policy = _policy_for(objects, account, "resourceslices")
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["operations"] == ["CREATE", "UPDATE", "DELETE"] and rule["apiGroups"] == ["resource.k8s.io"]
    text = _text(policy)
    assert "== 'gpu.acme.example'" in text and "authentication.kubernetes.io/node-name" in text
    assert find(_render({}), "ValidatingAdmissionPolicy", "gpu-topology-dra-resourceslices") == []


def test_the_plugins_policy_follows_the_prefix_and_the_gfd_labels() -> None:
    custom = _render({"annotationPrefix": "topo.acme.example", "plugin": {"sharing": SHARING}}, "prod", "gpu-system")
    (policy,) = find(custom, "ValidatingAdmissionPolicy", "prod-gpu-topology-plugin-node-patches")
    text = _text(policy)
    assert "gpu-topology.io" not in text
    for key in ("topo.acme.example/topology", "topo.acme.example/state", "topo.acme.example/autoscaler-hold",
                "topo.acme.example/fabric", "topo.acme.example/allreduce-gbps-", "topo.acme.example/nvlink-ring-",
                "topo.acme.example/free-gpus.",
                "topo.acme.example/one-replica-per-container.",
                *GFD):
        assert f"'{key}'" in text, key
    off = _render({"plugin": {"sharing": {**SHARING, "gfdLabels": False}}})
    (policy,) = find(off, "ValidatingAdmissionPolicy", "gpu-topology-plugin-node-patches")
    assert not any(label in _text(policy) for label in GFD), "GFD writes them: the plugin may not"
    assert find(_render({"plugin": {"enabled": False}}), "ValidatingAdmissionPolicy",
                "gpu-topology-plugin-node-patches") == []


def test_the_uninstall_hooks_account_is_not_matched() -> None:
    """The hook removes the plugin's keys from every node: matched, it would be refused all but none."""
    for policy in find(_render({"dra": {"enabled": True}}), "ValidatingAdmissionPolicy"):
        for condition in policy["spec"].get("matchConditions", []):
            assert "cleanup" not in condition["expression"], policy["metadata"]["name"]
            assert "==" in condition["expression"] or " in [" in condition["expression"], "names its accounts"


def test_the_manifests_carry_the_charts_node_policy() -> None:
    """deploy/manifests is the chart's defaults written out: the same policy, word for word."""
    (chart,) = find(_render({}), "ValidatingAdmissionPolicy", "gpu-topology-plugin-node-patches")
    (manifest,) = find(kustomize_build(MANIFESTS), "ValidatingAdmissionPolicy", "gpu-topology-plugin-node-patches")

    def normalised(policy: Obj) -> Obj:
        spec = copy.deepcopy(policy["spec"])
        for group in ("matchConditions", "variables", "validations"):
            for item in spec.get(group, []):
                for key in ("expression", "message", "messageExpression"):
                    if key in item:
                        item[key] = " ".join(item[key].split())
        return spec

    assert normalised(manifest) == normalised(chart)


def test_gfd_labels_auto_by_default_and_the_policy_admits_them_unless_off() -> None:
    """auto (the default): the plugin decides per node whether GPU Feature Discovery labels it, so the policy must
    admit the GFD keys; true and false pass the plugin's old flags; nothing else is taken."""
    for gfd, flags in ((None, []), ("auto", []), (True, ["--sharing-labels"]), (False, ["--no-sharing-labels"])):
        sharing = {**SHARING, **({"gfdLabels": gfd} if gfd is not None else {})}
        objects = _render({"plugin": {"sharing": sharing}})
        (ds,) = find(objects, "DaemonSet", "gpu-topology-plugin")
        args = [a for c in ds["spec"]["template"]["spec"]["containers"] for a in c.get("args") or []]
        assert [a for a in args if "sharing-labels" in a] == flags, gfd
        (policy,) = find(objects, "ValidatingAdmissionPolicy", "gpu-topology-plugin-node-patches")
        assert all(f"'{label}'" in _text(policy) for label in GFD) is (gfd is not False), gfd
    with pytest.raises(Exception, match="gfdLabels"):
        _render({"plugin": {"sharing": {**SHARING, "gfdLabels": "sometimes"}}})


def test_the_plugins_policy_lets_it_set_only_its_sharing_condition_on_its_nodes_status() -> None:
    (policy,) = find(_render({}), "ValidatingAdmissionPolicy", "gpu-topology-plugin-node-patches")
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["resources"] == ["nodes", "nodes/status"]
    assert "c.type != 'GPUSharingConfigValid'" in _text(policy)
