"""The Cluster Autoscaler (CA) as pure functions: what CA believes fits, and when it grows or shrinks a node group.

CA never calls a scheduler extender: it re-runs kube-scheduler's in-tree PreFilter/Filter plugins on a snapshot
(docs/reference/autoscaling.md 1.2). `fits` is that check for the plugins that decide GPU placement (NodeUnschedulable,
TaintToleration, NodeAffinity, NodeResourcesFit), on Kubernetes-shaped dicts, so a benchmark or a control-plane test
can ask "would CA think this pod fits this node?" without CA; no I/O. CA's scale-up and scale-down decisions are
not modelled: the real CA makes them (tests/helpers/autoscaler.py, bench.autoscale_real).

Not modelled in `fits`: NodePorts, volume plugins, InterPodAffinity, PodTopologySpread (none decide GPU fit here).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from decimal import Decimal, InvalidOperation
from typing import Any

from gputopo.podspec import affinity_matches, expression_matches, term_matches  # noqa: F401 (part of this model)

TO_BE_DELETED_TAINT = "ToBeDeletedByClusterAutoscaler"
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"

# kube-scheduler's wording (framework plugins), so tests and reports read like `kubectl describe pod`
AFFINITY_MISMATCH = "node(s) didn't match Pod's node affinity/selector"
UNSCHEDULABLE_NODE = "node(s) were unschedulable"
TOO_MANY_PODS = "Too many pods"

_FILTERED_EFFECTS = ("NoSchedule", "NoExecute")  # PreferNoSchedule is a scoring hint only
_SUFFIX = {
    "Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40), "Pi": Decimal(2**50),
    "Ei": Decimal(2**60), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
    "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15),
    "E": Decimal(10**18),
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?$")


# -- quantities and pod requests -------------------------------------------------------------------------------------


def parse_quantity(value: Any) -> Decimal:
    """A Kubernetes quantity ("500m", "1Gi", "2", 2). Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"quantity {value!r} is not a number")
    if isinstance(value, int | float):
        return Decimal(str(value))
    m = _QUANTITY.match(str(value).strip())
    if not m:
        raise ValueError(f"quantity {value!r} is not a Kubernetes quantity")
    try:
        return Decimal(m.group(1)) * _SUFFIX[m.group(2) or ""]
    except InvalidOperation:
        raise ValueError(f"quantity {value!r} is not a Kubernetes quantity") from None


def amount(resource: str, value: Any) -> int:
    """The integer kube-scheduler compares: millicores for cpu, else the value rounded up (Quantity.Value)."""
    if isinstance(value, int) and not isinstance(value, bool) and resource != "cpu":
        return value  # the common case in simulations, without Decimal
    q = parse_quantity(value)
    return math.ceil(q * 1000) if resource == "cpu" else math.ceil(q)


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _list(value: Any) -> Sequence[Any]:
    return value if isinstance(value, list | tuple) else ()


def container_requests(container: Mapping[str, Any]) -> dict[str, int]:
    """Requests after API defaulting: a resource given only in limits is requested at its limit."""
    res = _dict(container.get("resources"))
    out = {k: amount(k, v) for k, v in _dict(res.get("limits")).items()}
    out.update({k: amount(k, v) for k, v in _dict(res.get("requests")).items()})
    return out


def _add(into: dict[str, int], more: Mapping[str, int]) -> None:
    for k, v in more.items():
        into[k] = into.get(k, 0) + v


def pod_requests(pod: Mapping[str, Any]) -> dict[str, int]:
    """What NodeResourcesFit charges a pod (resource.PodRequests): max(app containers + sidecars, each init container
    + the sidecars started before it), plus spec.overhead."""
    spec = _dict(pod.get("spec"))
    total: dict[str, int] = {}
    for c in _list(spec.get("containers")):
        _add(total, container_requests(_dict(c)))
    sidecars: dict[str, int] = {}
    init_peak: dict[str, int] = {}
    for c in _list(spec.get("initContainers")):
        req = container_requests(_dict(c))
        if _dict(c).get("restartPolicy") == "Always":  # sidecar: runs on beside everything after it
            _add(sidecars, req)
            step = dict(sidecars)
        else:
            step = dict(sidecars)
            _add(step, req)
        for k, v in step.items():
            init_peak[k] = max(init_peak.get(k, 0), v)
    _add(total, sidecars)
    for k, v in init_peak.items():
        total[k] = max(total.get(k, 0), v)
    _add(total, {k: amount(k, v) for k, v in _dict(spec.get("overhead")).items()})
    return {k: v for k, v in total.items() if v}


# -- the in-tree filters -------------------------------------------------------------------------------------------


def tolerates(toleration: Mapping[str, Any], taint: Mapping[str, Any]) -> bool:
    """v1.Toleration.ToleratesTaint: an empty effect matches every effect, an empty key (with Exists) every key."""
    effect = toleration.get("effect") or ""
    if effect and effect != taint.get("effect"):
        return False
    key = toleration.get("key") or ""
    if key and key != taint.get("key"):
        return False
    op = toleration.get("operator") or "Equal"
    if op == "Exists":
        return True
    if op == "Equal":
        return (toleration.get("value") or "") == (taint.get("value") or "")
    return False


def untolerated_taint(pod: Mapping[str, Any], node: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The first NoSchedule/NoExecute taint none of the pod's tolerations tolerates (TaintToleration Filter)."""
    tolerations = [_dict(t) for t in _list(_dict(pod.get("spec")).get("tolerations"))]
    for taint in _list(_dict(node.get("spec")).get("taints")):
        taint = _dict(taint)
        if taint.get("effect") not in _FILTERED_EFFECTS:
            continue
        if not any(tolerates(t, taint) for t in tolerations):
            return taint
    return None


def allocatable(node: Mapping[str, Any]) -> dict[str, int]:
    return {k: amount(k, v) for k, v in _dict(_dict(node.get("status")).get("allocatable")).items()}


def insufficient(requests: Mapping[str, int], alloc: Mapping[str, int], used: Mapping[str, int]) -> list[str]:
    """NodeResourcesFit: every requested resource (zero requests skipped) within allocatable minus requested; a
    resource the node does not advertise has none. The pod count is checked when the node advertises `pods`."""
    out = []
    if "pods" in alloc and used.get("pods", 0) + 1 > alloc["pods"]:
        out.append(TOO_MANY_PODS)
    for name, want in sorted(requests.items()):
        if name == "pods" or want <= 0:
            continue
        if want > alloc.get(name, 0) - used.get(name, 0):
            out.append(f"Insufficient {name}")
    return out


def fits(pod: Mapping[str, Any], node: Mapping[str, Any], used: Mapping[str, int],
         requests: Mapping[str, int] | None = None) -> str | None:
    """None when CA's in-tree filters accept `pod` on `node` with `used` (resource -> amount already requested there;
    cpu in millicores, `pods` = pods on the node), else kube-scheduler's reason. Plugins in kube-scheduler's order:
    NodeUnschedulable, TaintToleration, NodeAffinity, NodeResourcesFit. `requests` skips re-reading the pod spec."""
    if _dict(node.get("spec")).get("unschedulable"):
        cordon = {"key": UNSCHEDULABLE_TAINT, "effect": "NoSchedule"}
        if not any(tolerates(_dict(t), cordon) for t in _list(_dict(pod.get("spec")).get("tolerations"))):
            return UNSCHEDULABLE_NODE
    taint = untolerated_taint(pod, node)
    if taint is not None:
        return f"node(s) had untolerated taint {{{taint.get('key')}: {taint.get('value') or ''}}}"
    if not affinity_matches(pod, node):
        return AFFINITY_MISMATCH
    short = insufficient(pod_requests(pod) if requests is None else requests, allocatable(node), used)
    return ", ".join(short) if short else None


# -- GPU nodes, utilisation, drainability --------------------------------------------------------------------------
