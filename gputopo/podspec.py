"""How many devices of a resource a pod asks for, counted as the kubelet counts them; shared by both halves.

The kubelet's rule for a pod's effective request of a resource (k8s.io/component-helpers resource.PodRequests):
app containers and sidecars (init containers with restartPolicy Always) run together, so their requests add up; a
regular init container runs alone next to the sidecars started before it; the pod needs the larger of the two.
Extended resources take the limit when one is set (requests must equal limits for them), else the request.

Read straight from the Pod's JSON dict (the extender's filter hot path; the plugin's pod watch): no model classes.
Container names must be unique across init and app containers, as the apiserver requires: a plan names its
containers, so two of one name would share one part of a plan while counting twice.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gputopo.quantity import QuantityError, device_count

INIT, SIDECAR, APP = "init", "sidecar", "app"
MAX_DEVICES_PER_POD = 4096


class PodSpecError(ValueError):
    """The pod's spec or annotations cannot be read for device placement; the message names the field."""


@dataclass(frozen=True)
class ContainerNeed:
    name: str
    count: int
    kind: str  # INIT, SIDECAR or APP


def count_quantity(value: Any, where: str) -> int:
    """A whole device count from a quantity (gputopo.quantity), or PodSpecError naming `where`."""
    try:
        return device_count(value, MAX_DEVICES_PER_POD)
    except QuantityError as e:
        raise PodSpecError(f"{where}: {e}") from None


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _container_count(container: Mapping[str, Any], resource: str, where: str) -> int:
    res = _dict(container.get("resources"))
    limits, requests = _dict(res.get("limits")), _dict(res.get("requests"))
    if resource in limits:
        return count_quantity(limits[resource], f"{where} limits[{resource}]")
    if resource in requests:
        return count_quantity(requests[resource], f"{where} requests[{resource}]")
    return 0


def container_needs(pod: Mapping[str, Any], resource: str) -> tuple[ContainerNeed, ...]:
    """Every container's count, init containers first in spec order (sidecars marked), then app containers.
    Raises PodSpecError for a malformed spec, a bad quantity or a repeated container name."""
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        raise PodSpecError("pod has no spec object")
    out: list[ContainerNeed] = []
    seen: dict[str, str] = {}
    for field, kind in (("initContainers", INIT), ("containers", APP)):
        items = spec.get(field)
        if items is None:
            continue
        if not isinstance(items, list):
            raise PodSpecError(f"spec.{field} must be a list")
        for i, c in enumerate(items):
            if not isinstance(c, dict):
                raise PodSpecError(f"spec.{field}[{i}] must be an object")
            name = c.get("name")
            if not isinstance(name, str) or not name:
                raise PodSpecError(f"spec.{field}[{i}] has no name")
            if name in seen:
                raise PodSpecError(f"spec.{field}[{i}] repeats the container name {name!r} of {seen[name]}: "
                                   "container names must be unique")
            seen[name] = f"spec.{field}[{i}]"
            k = SIDECAR if kind == INIT and c.get("restartPolicy") == "Always" else kind
            out.append(ContainerNeed(name, _container_count(c, resource, f"{field}[{name}]"), k))
    return tuple(out)


def effective_count(containers: Sequence[ContainerNeed]) -> int:
    """The kubelet's rule: max(sum of app containers + sidecars, each init container + sidecars started before it)."""
    sidecars = 0
    init_peak = 0
    for c in containers:
        if c.kind == SIDECAR:
            sidecars += c.count
            init_peak = max(init_peak, sidecars)
        elif c.kind == INIT:
            init_peak = max(init_peak, sidecars + c.count)
    apps = sum(c.count for c in containers if c.kind == APP)
    return max(init_peak, apps + sidecars)


def pod_device_count(pod: Mapping[str, Any], resource: str) -> int:
    """The pod's effective request of `resource`. Raises PodSpecError."""
    return effective_count(container_needs(pod, resource))


# -- where a pod may run: kube-scheduler's NodeAffinity filter, on the JSON dicts ------------------------------------

# what Go's strconv.ParseInt(s, 10, 64) accepts, range checked apart (fullmatch: `$` would let a trailing "\n" in)
_INT64 = re.compile(r"[+-]?[0-9]+")


def _sequence(value: Any) -> Sequence[Any]:
    return value if isinstance(value, list | tuple) else ()


def _int64(text: Any) -> int | None:
    if not isinstance(text, str) or not _INT64.fullmatch(text):
        return None
    n = int(text)
    return n if -(2**63) <= n < 2**63 else None


def expression_matches(expr: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    """One nodeSelectorRequirement. A malformed one (In without values, Gt with two, a non-integer bound) matches
    nothing, as kube-scheduler drops a term it cannot parse."""
    key, op = expr.get("key"), expr.get("operator")
    values = [str(v) for v in _sequence(expr.get("values"))]
    present = key in labels
    if op in ("In", "NotIn"):
        if not values:
            return False
        inside = present and labels[key] in values  # type: ignore[index]
        return inside if op == "In" else not inside
    if op in ("Exists", "DoesNotExist"):
        if values:
            return False
        return present if op == "Exists" else not present
    if op in ("Gt", "Lt"):
        if len(values) != 1:
            return False
        bound = _int64(values[0])
        have = _int64(labels.get(key)) if present else None  # type: ignore[arg-type]
        if bound is None or have is None:
            return False
        return have > bound if op == "Gt" else have < bound
    return False


def _field_matches(expr: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    """matchFields: only metadata.name, with In or NotIn."""
    if expr.get("key") != "metadata.name" or expr.get("operator") not in ("In", "NotIn"):
        return False
    return expression_matches(expr, {"metadata.name": str(_dict(node.get("metadata")).get("name") or "")})


def term_matches(term: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    """A nodeSelectorTerm: its expressions and fields ANDed; an empty term matches nothing."""
    exprs = [_dict(e) for e in _sequence(term.get("matchExpressions"))]
    fields = [_dict(e) for e in _sequence(term.get("matchFields"))]
    if not exprs and not fields:
        return False
    labels = _dict(_dict(node.get("metadata")).get("labels"))
    return all(expression_matches(e, labels) for e in exprs) and all(_field_matches(f, node) for f in fields)


def affinity_matches(pod: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    """NodeAffinity Filter: spec.nodeSelector (every label equal) AND the required terms (ORed)."""
    spec = _dict(pod.get("spec"))
    labels = _dict(_dict(node.get("metadata")).get("labels"))
    for k, v in _dict(spec.get("nodeSelector")).items():
        if labels.get(k) != v:
            return False
    required = _dict(_dict(_dict(spec.get("affinity")).get("nodeAffinity")).get(
        "requiredDuringSchedulingIgnoredDuringExecution"))
    if not required:
        return True
    return any(term_matches(_dict(t), node) for t in _sequence(required.get("nodeSelectorTerms")))
