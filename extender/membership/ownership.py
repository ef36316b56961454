"""The owner objects the extender watches (extender.membership.owners' kinds), and a pod's job size read from them.

Fed by one watch per kind (extender.state.cluster), like the group objects (extender.membership.groups): a kind that is
not installed, not granted, or not listed in `--job-owner-kinds` is absent, and a pod whose owner is of that kind is
sized from its env where the operator wrote one, else not at all, with the reason saying why ("PyTorchJob ml/x is
not readable: kubeflow.org/v1 pytorchjobs forbidden"). Read on the filter path without a lock (`size_of`: plain
dict reads). Bounded: past MAX_OWNERS objects new ones are ignored (logged once) until some go away.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import structlog

from extender.membership.job import OwnerSize
from extender.membership.owners import (
    OWNER_APIS,
    OWNER_KINDS,
    OwnerError,
    OwnerRef,
    OwnerShape,
    owner_shape_of,
    owners_of_pod,
    size_from_env,
)
from gputopo.kube.fetching import ApiResource

log = structlog.get_logger(__name__)

MAX_OWNERS = 100_000
OWNER_RESOURCES: tuple[ApiResource, ...] = tuple(ApiResource(*api) for api in OWNER_APIS)
NOT_WATCHED = "not watched (--job-owner-kinds)"
NOT_SEEN = "not seen yet"  # its kind is listed, no object of that name is


class OwnerShapes:
    """OwnerRef -> OwnerShape for every owner object seen, and why each kind is not being read."""

    def __init__(self, resource_name: str, kinds: Iterable[str] = OWNER_KINDS, limit: int = MAX_OWNERS) -> None:
        self.resource_name = resource_name
        self.limit = limit
        self.kinds = frozenset(kinds)
        self.shapes: dict[OwnerRef, OwnerShape] = {}
        self._by_resource: dict[str, set[OwnerRef]] = {}
        # resource -> why it is absent ("not installed", "forbidden"); resources not listed yet: "not seen yet"
        self._absent: dict[str, str] = {}
        self._listed: set[str] = set()
        self._lock = threading.Lock()
        self._reported: dict[OwnerRef, str] = {}
        self._full_reported = False
        self.on_change: Callable[[], None] = lambda: None  # the cache wakes its waiters

    def __len__(self) -> int:
        return len(self.shapes)

    @property
    def resources(self) -> tuple[ApiResource, ...]:
        """The resources to watch: those of the kinds chosen."""
        return tuple(r for r in OWNER_RESOURCES if r.kind in self.kinds)

    # -- fed by the watches --------------------------------------------------------------------------------------

    def apply(self, resource: ApiResource, event_type: str, obj: dict[str, Any]) -> None:
        """One watch event: ADDED / MODIFIED set the object's shape, DELETED drops it."""
        obj = {**obj, "apiVersion": obj.get("apiVersion") or resource.api_version,
               "kind": obj.get("kind") or resource.kind}
        meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
        if not isinstance(meta.get("name"), str):
            return
        ref = OwnerRef(resource.group, resource.kind, str(meta.get("namespace") or "default"), meta["name"])
        shape = self._parse(ref, obj) if event_type != "DELETED" else None
        with self._lock:
            owned = self._by_resource.setdefault(_key(resource), set())
            if shape is None:
                if ref in owned:
                    owned.discard(ref)
                    self.shapes.pop(ref, None)
            elif ref not in self.shapes and len(self.shapes) >= self.limit:
                if not self._full_reported:
                    log.warning("extender.owners.full", limit=self.limit, ignored=str(ref))
                    self._full_reported = True
            else:
                if ref not in self.shapes:
                    log.debug("extender.owners.seen", owner=str(ref), gpu_pods=shape.gpu_pods)
                owned.add(ref)
                self.shapes[ref] = shape
            if len(self.shapes) < self.limit:
                self._full_reported = False
        self.on_change()

    def sync(self, resource: ApiResource, items: Iterable[Any], absent: str | None = None) -> None:
        """A fresh list of `resource` (empty, with `absent` saying why, when it is not served or not granted)."""
        seen: set[OwnerRef] = set()
        for item in items:
            if isinstance(item, dict):
                self.apply(resource, "ADDED", item)
                meta = item.get("metadata") if isinstance(item.get("metadata"), dict) else {}
                if isinstance(meta.get("name"), str):
                    seen.add(OwnerRef(resource.group, resource.kind, str(meta.get("namespace") or "default"),
                                      meta["name"]))
        with self._lock:
            owned = self._by_resource.setdefault(_key(resource), set())
            for ref in owned - seen:
                self.shapes.pop(ref, None)
            owned &= seen
            self._listed.add(_key(resource))
            if absent is None:
                self._absent.pop(_key(resource), None)
            else:
                self._absent[_key(resource)] = absent
        self.on_change()

    def _parse(self, ref: OwnerRef, obj: dict[str, Any]) -> OwnerShape | None:
        try:
            shape = owner_shape_of(obj, self.resource_name)
        except OwnerError as e:
            problem = str(e)
            if self._reported.get(ref) != problem:
                if len(self._reported) >= self.limit:
                    self._reported.clear()
                self._reported[ref] = problem
                log.warning("extender.owners.ignored", owner=str(ref), problem=problem)
            return None
        self._reported.pop(ref, None)
        return shape

    # -- read by job membership ------------------------------------------------------------------------------

    def size_of(self, pod: Mapping[str, Any]) -> OwnerSize:
        """The GPU pods of the pod's job and where that was read, or why it is unknown."""
        owners = owners_of_pod(pod)
        why: list[str] = []
        for owner in owners:
            shape = self.shapes.get(owner.ref)
            if shape is not None and (owner.uid is None or shape.uid in (None, owner.uid)):
                problem = shape.problem
                if problem is None:
                    return OwnerSize(shape.gpu_pods, shape.summary)
                why.append(problem)
            elif shape is not None:
                why.append(f"{owner.ref} seen is another object of that name (uid {shape.uid})")
            elif owner.label is None:
                why.append(f"{owner.ref} is not readable: {self._unread(owner.ref)}")
            else:  # named by a label only: the pod may have no owner at all, and "not seen yet" would promise one
                unread = self._unread(owner.ref)
                seen = f"no {owner.ref} seen" if unread == NOT_SEEN else f"{owner.ref} is not readable: {unread}"
                referenced = isinstance(pod.get("metadata"), dict) and pod["metadata"].get("ownerReferences")
                why.append(f"{'label' if referenced else 'no ownerReference; label'} {owner.label}: {seen}")
        env = size_from_env(pod)
        if env is not None:
            return OwnerSize(env[0], env[1] + (f" ({why[0]})" if why else ""), from_env=True)
        if not owners:
            return OwnerSize(None, "no owner object of a kind read here, no size in its env")
        return OwnerSize(None, why[0])

    def gpus_per_pod(self, pod: Mapping[str, Any]) -> int | None:
        """The GPUs each GPU pod of the pod's job asks, as the owner that sizes it (`size_of`'s first readable one)
        says; None when no owner seen says it. What a CPU-only pod arriving first (a TFJob's parameter server)
        needs to plan its job's GPU pods before any of them exists."""
        for owner in owners_of_pod(pod):
            shape = self.shapes.get(owner.ref)
            if shape is not None and (owner.uid is None or shape.uid in (None, owner.uid)) and shape.problem is None:
                return shape.gpus_per_pod
        return None

    def _unread(self, ref: OwnerRef) -> str:
        if ref.kind not in self.kinds:
            return NOT_WATCHED
        resources = [r for r in OWNER_RESOURCES if r.kind == ref.kind and r.group == ref.group]
        reasons = [f"{r.api_version} {r.plural} {self._absent[_key(r)]}" for r in resources if _key(r) in self._absent]
        if len(reasons) == len(resources):
            return "; ".join(reasons)
        if not all(_key(r) in self._listed for r in resources):
            return "its kind is not listed yet"
        return NOT_SEEN


def _key(resource: ApiResource) -> str:
    """Versions apart: MPIJob v1 and v2beta1 are one plural of one group, and at most one of them is served."""
    return f"{resource.plural}.{resource.version}.{resource.group}"
