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
