"""coordination.k8s.io/v1 Leases on the in-process kube-apiserver: get, create, replace, list and watch of Leases,
with the apiserver's optimistic concurrency (a replace whose resourceVersion is not the stored one is a 409
Conflict), which is what makes leader election safe. A subclass of FakeKubeApi that adds routes, as dra.py does.
"""

from __future__ import annotations

from typing import Any

import orjson

from tests.fakes.kubeapi.objects import Obj, clone, now
from tests.fakes.kubeapi.server import FakeKubeApi
from tests.fakes.kubeapi.status import ApiError, bad_request, conflict, method_not_allowed, no_resource, not_found

LEASES = "leases.coordination.k8s.io"
_PREFIX = ["apis", "coordination.k8s.io", "v1", "namespaces"]


class FakeLeasesKubeApi(FakeKubeApi):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._store[LEASES] = {}

    # -- test-facing state -----------------------------------------------------------------------------------

    def lease(self, namespace: str, name: str) -> Obj | None:
        with self._cond:
            obj = self._store[LEASES].get(f"{namespace}/{name}")
        return clone(obj) if obj is not None else None

    def holder(self, namespace: str, name: str) -> str | None:
        lease = self.lease(namespace, name)
        return (lease or {}).get("spec", {}).get("holderIdentity")

    # -- routing ---------------------------------------------------------------------------------------------

    def _route(self, h: Any, method: str, path: str, query: dict[str, str], body: bytes) -> None:
        parts = path.strip("/").split("/")
        if parts[:4] != _PREFIX:
            super()._route(h, method, path, query, body)
            return
        rest = parts[4:]
        if len(rest) < 2 or rest[1] != "leases" or len(rest) > 3:
            raise ApiError(no_resource())
        namespace = rest[0]
        if len(rest) == 2:
            if method == "GET":  # list and watch (a follower watches the Lease to take it once released)
                self._list_or_watch(h, LEASES, namespace, query)
                return
            if method != "POST":
                raise ApiError(method_not_allowed())
            h.send_json(201, self._create_lease(namespace, _decode(body)))
            return
        name = rest[2]
        if method == "GET":
            h.send_json(200, self._get(LEASES, f"{namespace}/{name}", name))
        elif method == "PUT":
            h.send_json(200, self._replace_lease(namespace, name, _decode(body)))
        else:
            raise ApiError(method_not_allowed())

    def _create_lease(self, namespace: str, obj: Obj) -> Obj:
        meta_in = obj.get("metadata") or {}
        name = meta_in.get("name")
        if not isinstance(name, str) or not name:
            raise ApiError(bad_request("metadata.name: Required value"))
        key = f"{namespace}/{name}"
        new: Obj = {"kind": "Lease", "apiVersion": "coordination.k8s.io/v1",
                    "metadata": {"name": name, "namespace": namespace, "uid": f"uid-lease-{name}",
                                 "creationTimestamp": now(), "resourceVersion": "0"},
                    "spec": clone(obj.get("spec") or {})}
        with self._cond:
            if key in self._store[LEASES]:
                raise ApiError(conflict(LEASES, name, "already exists"))
            new["metadata"]["resourceVersion"] = str(self._next_rv())
            self._store[LEASES][key] = new
            self._record(LEASES, "ADDED", new, None)
        return new

    def _replace_lease(self, namespace: str, name: str, obj: Obj) -> Obj:
        key = f"{namespace}/{name}"
        with self._cond:
            old = self._store[LEASES].get(key)
            if old is None:
                raise ApiError(not_found(LEASES, name))
            rv = (obj.get("metadata") or {}).get("resourceVersion")
            if rv and rv != old["metadata"]["resourceVersion"]:  # none given: an unconditional update
                raise ApiError(conflict(LEASES, name, "the object has been modified; please apply your changes "
                                                      "to the latest version and try again"))
            new = clone(old)
            new["spec"] = clone(obj.get("spec") or {})
            return self._put(LEASES, key, new, old)


def _decode(body: bytes) -> Obj:
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise ApiError(bad_request(f"the body is not JSON: {e}")) from None
    if not isinstance(obj, dict):
        raise ApiError(bad_request("the body is not an object"))
    return obj
