"""Job sizes from the group objects gang schedulers keep: PodGroup minMember / minCount and Workload minCount.

Fed by one watch per kind (extender.state.cluster) where the API exists: a kind that is not installed (no CRD, the alpha
API off) or that RBAC does not grant is absent, not an error (gputopo.kube.watching's `absent_retry_s`). Read by
job membership (`sizes`, a plain dict read without a lock on the filter path). Bounded: past MAX_GROUPS objects new
ones are ignored (logged once) until some go away. An object whose minimum is not a pod count is ignored, logged
once per object and value, and its pods' jobs then have no size from it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import structlog

from extender.membership.job import GroupRef, MembershipError, group_sizes_of
from gputopo.kube.fetching import ApiResource

log = structlog.get_logger(__name__)

MAX_GROUPS = 100_000
# The kinds whose minimum sizes a job (extender.membership.job's GroupKind), as the apiserver serves them.
GROUP_RESOURCES: tuple[ApiResource, ...] = (
    ApiResource("scheduling.x-k8s.io", "v1alpha1", "podgroups", "PodGroup"),  # scheduler-plugins coscheduling
    ApiResource("scheduling.volcano.sh", "v1beta1", "podgroups", "PodGroup"),  # Volcano
    ApiResource("scheduling.k8s.io", "v1alpha2", "podgroups", "PodGroup"),  # Workload API, runtime groups (1.36)
    ApiResource("scheduling.k8s.io", "v1alpha1", "workloads", "Workload"),  # Workload API (1.35)
)

_ObjectKey = tuple[str, str, str]  # (resource, namespace, name)


class GroupSizes:
    """GroupRef -> pods in the group's gang minimum, for every group object seen."""

    def __init__(self, limit: int = MAX_GROUPS) -> None:
        self.limit = limit
        self.sizes: dict[GroupRef, int] = {}
        self._refs: dict[_ObjectKey, tuple[GroupRef, ...]] = {}
        self._lock = threading.Lock()
        self._reported: dict[_ObjectKey, str] = {}
        self._full_reported = False
        self.on_change: Callable[[], None] = lambda: None  # the cache wakes its waiters

    def __len__(self) -> int:
        return len(self._refs)

    def apply(self, resource: ApiResource, event_type: str, obj: dict[str, Any]) -> None:
        """One watch event of `resource`: ADDED / MODIFIED set the object's sizes, DELETED drops them."""
        key = _object_key(resource, obj)
        if key is None:
            return
        refs = self._parse(resource, key, obj) if event_type != "DELETED" else None
        with self._lock:
            self._forget(key)
            if refs is not None and len(self._refs) >= self.limit:
                if not self._full_reported:
                    log.warning("extender.groups.full", limit=self.limit, ignored=f"{key[0]} {key[1]}/{key[2]}")
                    self._full_reported = True
            elif refs is not None:
                self._refs[key] = tuple(refs)
                self.sizes.update(refs)
        self.on_change()

    def sync(self, resource: ApiResource, items: Iterable[Any]) -> None:
        """A fresh list of `resource` (empty when it is absent): its objects replace every one seen before."""
        seen = set()
        for item in items:
            if isinstance(item, dict):
                item = {"apiVersion": resource.api_version, "kind": resource.kind, **item}  # list items may lack them
                self.apply(resource, "ADDED", item)
                key = _object_key(resource, item)
                if key is not None:
                    seen.add(key)
        with self._lock:
            for key in [k for k in self._refs if k[0] == str(resource) and k not in seen]:
                self._forget(key)
        self.on_change()

    def _forget(self, key: _ObjectKey) -> None:
        for ref in self._refs.pop(key, ()):
            self.sizes.pop(ref, None)
        if len(self._refs) < self.limit:
            self._full_reported = False

    def _parse(self, resource: ApiResource, key: _ObjectKey, obj: dict[str, Any]) -> dict[GroupRef, int] | None:
        obj = {**obj, "apiVersion": obj.get("apiVersion") or resource.api_version,
               "kind": obj.get("kind") or resource.kind}
        try:
            refs = group_sizes_of(obj)
        except MembershipError as e:
            problem = str(e)
            if self._reported.get(key) != problem:
                if len(self._reported) >= self.limit:
                    self._reported.clear()
                self._reported[key] = problem
                log.warning("extender.groups.ignored", group=f"{key[0]} {key[1]}/{key[2]}", problem=problem)
            return None
        self._reported.pop(key, None)
        return refs


def _object_key(resource: ApiResource, obj: dict[str, Any]) -> _ObjectKey | None:
    meta = obj.get("metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
        return None
    return (str(resource), str(meta.get("namespace") or "default"), meta["name"])
