"""The gang schedulers' group objects on the in-process kube-apiserver: PodGroups and Workloads, list and watch.

A subclass of FakeKubeApi that adds routes, as dra.py does. Served, each only when
"installed" (a CRD applied, an alpha API switched on): scheduler-plugins `scheduling.x-k8s.io/v1alpha1 podgroups`,
Volcano `scheduling.volcano.sh/v1beta1 podgroups`, Kubernetes `scheduling.k8s.io/v1alpha2 podgroups` and
`scheduling.k8s.io/v1alpha1 workloads`. A resource that is not installed answers 404 with the apiserver's "could not
find the requested resource" Status, as a group or version the apiserver does not serve does. Objects keep kind and
apiVersion in list items for custom resources (the apiserver serves CRs that way) and drop them for the built-in
scheduling.k8s.io kinds, as for every built-in list.
"""

from __future__ import annotations

from typing import Any

from tests.fakes.kubeapi.objects import Obj
from tests.fakes.kubeapi.objects import clone as _copy
from tests.fakes.kubeapi.objects import now as _now
from tests.fakes.kubeapi.selectors import Selector, parse_label_selector
from tests.fakes.kubeapi.server import FakeKubeApi
from tests.fakes.kubeapi.status import ApiError, conflict, not_found
from tests.fakes.kubeapi.status import method_not_allowed as _method_not_allowed
from tests.fakes.kubeapi.status import no_resource as _no_resource

# (group, version, plural) -> (kind, served as a custom resource)
RESOURCES: dict[tuple[str, str, str], tuple[str, bool]] = {
    ("scheduling.x-k8s.io", "v1alpha1", "podgroups"): ("PodGroup", True),
    ("scheduling.volcano.sh", "v1beta1", "podgroups"): ("PodGroup", True),
    ("scheduling.k8s.io", "v1alpha2", "podgroups"): ("PodGroup", False),
    ("scheduling.k8s.io", "v1alpha1", "workloads"): ("Workload", False),
}


def _store_key(group: str, version: str, plural: str) -> str:
    return f"{plural}.{version}.{group}"


class FakeGroupsKubeApi(FakeKubeApi):
    """FakeKubeApi plus the group kinds of RESOURCES; `installed` says which are served (all by default). A subclass
    serving more kinds the same way (tests/fakes/kubeapi/jobs.py) sets SERVED."""

    SERVED: dict[tuple[str, str, str], tuple[str, bool]] = RESOURCES

    def __init__(self, *, installed: set[tuple[str, str, str]] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.installed = set(self.SERVED) if installed is None else set(installed)
        self._groups = {_store_key(*r): r for r in self.SERVED}
        for key in self._groups:
            self._store[key] = {}

    # -- test-facing state -----------------------------------------------------------------------------------

    def add_group(self, obj: Obj) -> Obj:
        """Create a PodGroup or Workload; its apiVersion and kind say which resource it is."""
        group, _, version = str(obj.get("apiVersion", "")).partition("/")
        for (g, v, plural), (kind, _) in self.SERVED.items():
            if (g, v) == (group, version) and kind == obj.get("kind"):
                return _copy(self._create_group(_store_key(g, v, plural), obj))
        raise ValueError(f"no group resource for {obj.get('apiVersion')} {obj.get('kind')}")

    def update_group(self, api_version: str, kind: str, namespace: str, name: str, change: Obj) -> Obj:
        return _copy(self._update(self._resource_of(api_version, kind), f"{namespace}/{name}", change))

    def delete_group(self, api_version: str, kind: str, namespace: str, name: str) -> Obj:
        return _copy(self._delete(self._resource_of(api_version, kind), f"{namespace}/{name}"))

    def _resource_of(self, api_version: str, kind: str) -> str:
        group, _, version = api_version.partition("/")
        for (g, v, plural), (k, _) in self.SERVED.items():
            if (g, v, k) == (group, version, kind):
                return _store_key(g, v, plural)
        raise ValueError(f"no group resource for {api_version} {kind}")

    # -- routing ---------------------------------------------------------------------------------------------

    def _route(self, h: Any, method: str, path: str, query: dict[str, str], body: bytes) -> None:
        parts = path.strip("/").split("/")
        if len(parts) < 4 or parts[0] != "apis" or not any(parts[1] == g for g, _, _ in self.SERVED):
            super()._route(h, method, path, query, body)
            return
        group, version, rest = parts[1], parts[2], parts[3:]
        namespace = None
        if rest[:1] == ["namespaces"] and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        ident = (group, version, rest[0]) if rest else None
        if ident is None or ident not in self.SERVED or ident not in self.installed:
            self._missing(h, ident)
            return
        resource = _store_key(*ident)
        rest = rest[1:]
        if not rest:
            if method != "GET":
                raise ApiError(_method_not_allowed())
            self._list_or_watch(h, resource, namespace, query)
            return
        if namespace is None or len(rest) != 1:
            raise ApiError(_no_resource())
        if method != "GET":
            raise ApiError(_method_not_allowed())
        with self._cond:
            obj = self._store[resource].get(f"{namespace}/{rest[0]}")
        if obj is None:
            raise ApiError(not_found(f"{ident[2]}.{group}", rest[0]))
        h.send_json(200, obj)

    def _missing(self, h: Any, ident: tuple[str, str, str] | None) -> None:
        """A resource that is not served: the "could not find the requested resource" Status."""
        raise ApiError(_no_resource())

    # -- objects ---------------------------------------------------------------------------------------------

    def _selector(self, resource: str, namespace: str | None, query: dict[str, str]) -> Selector:
        if resource not in self._groups:
            return super()._selector(resource, namespace, query)
        return Selector(namespace, tuple(parse_label_selector(query.get("labelSelector", ""))), ())

    def _list(self, resource: str, selector: Selector, query: dict[str, str]) -> Obj:
        out = super()._list(resource, selector, query)
        if resource in self._groups:
            group, version, plural = self._groups[resource]
            kind, custom = self.SERVED[(group, version, plural)]
            out["kind"], out["apiVersion"] = f"{kind}List", f"{group}/{version}"
            if custom:  # custom resources keep kind and apiVersion in each item
                out["items"] = [{"apiVersion": f"{group}/{version}", "kind": kind, **i} for i in out["items"]]
        return out

    def _create_group(self, resource: str, obj: Obj) -> Obj:
        meta_in = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
        name = meta_in.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError("object needs metadata.name")
        group, version, _ = self._groups[resource]
        meta: Obj = {"name": name, "namespace": meta_in.get("namespace") or "default",
                     "uid": meta_in.get("uid") or f"uid-{resource}-{name}", "resourceVersion": "0",
                     "generation": 1, "creationTimestamp": _now()}
        for k, v in meta_in.items():
            meta.setdefault(k, v)
        new: Obj = {"apiVersion": f"{group}/{version}", "kind": obj["kind"], "metadata": meta,
                    "spec": _copy(obj.get("spec") or {})}
        if "status" in obj:
            new["status"] = _copy(obj["status"])
        key = f"{meta['namespace']}/{name}"
        with self._cond:
            if key in self._store[resource]:
                raise ApiError(conflict(resource, name, "already exists"))
            new["metadata"]["resourceVersion"] = str(self._next_rv())
            self._store[resource][key] = new
            self._record(resource, "ADDED", new, None)
        return new
