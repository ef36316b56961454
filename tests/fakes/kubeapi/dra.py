"""resource.k8s.io/v1 on the in-process kube-apiserver: ResourceSlices, ResourceClaims and DeviceClasses.

A subclass of FakeKubeApi that adds routes, the way to serve another API group on the fake.
Shapes follow the kube-apiserver v1.36.2 bodies recorded in fixtures/recordings/kube-apiserver-dra: objects with
kind/apiVersion, `metadata.generation`, a created claim with `"status": {}`, lists `ResourceSliceList`, and the
422 Status bodies for slices over the limits (64 counter-consuming / 128 devices per slice, 2 counter sets per
device, a counter set twice, `devices` and `sharedCounters` together). Slices take `generateName`; field selectors
`spec.driver`, `spec.nodeName` and `metadata.name` select them, for list, watch and delete-collection.

Consumable capacity (KEP-5075) as the apiserver's validation.go checks it: a capacity's requestPolicy only on a
device with allowMultipleAllocations, not validValues and validRange together, a default inside the policy, min and
max within the value, a range a whole number of steps from min, at most 10 ascending validValues. `capacity` picks
the apiserver: "on" (1.36 defaults), "off" (the DRAConsumableCapacity gate off: the fields are dropped on write, as
dropDisabledFields does) or "invalid" (422 for any multi-allocatable device, an apiserver that refuses them).
"""

from __future__ import annotations

import random
from decimal import Decimal
from typing import Any

from gputopo.quantity import QuantityError, parse_quantity
from tests.fakes.kubeapi.core import decode_body
from tests.fakes.kubeapi.objects import Obj, clone, now
from tests.fakes.kubeapi.selectors import FieldReq, Selector, parse_label_selector
from tests.fakes.kubeapi.server import FakeKubeApi
from tests.fakes.kubeapi.status import (
    ApiError,
    bad_request,
    conflict,
    invalid,
    method_not_allowed,
    no_resource,
    not_found,
    status_success,
)

GROUP_VERSION = "resource.k8s.io/v1"
KINDS = {"resourceslices": "ResourceSlice", "resourceclaims": "ResourceClaim", "deviceclasses": "DeviceClass"}
NAMESPACED = {"resourceclaims"}
FIELDS = {
    "resourceslices": ("metadata.name", "spec.driver", "spec.nodeName"),
    "resourceclaims": ("metadata.name", "metadata.namespace"),
    "deviceclasses": ("metadata.name",),
}
_SUFFIX = "bcdfghjklmnpqrstvwxz2456789"  # the apiserver's generateName alphabet


class FakeDraKubeApi(FakeKubeApi):
    """FakeKubeApi plus resource.k8s.io/v1 (see the module docstring)."""

    def __init__(self, *, capacity: str = "on", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        assert capacity in ("on", "off", "invalid")
        self.capacity = capacity
        for resource in KINDS:
            self._store[resource] = {}
        self._rng = random.Random(0)

    # -- test-facing state -----------------------------------------------------------------------------------

    def slices(self, node: str | None = None) -> list[Obj]:
        with self._cond:
            return [clone(o) for _, o in sorted(self._store["resourceslices"].items())
                    if node is None or o["spec"].get("nodeName") == node]

    def add_claim(self, obj: Obj) -> Obj:
        return clone(self._create_object("resourceclaims", obj))

    def claim(self, namespace: str, name: str) -> Obj | None:
        with self._cond:
            obj = self._store["resourceclaims"].get(f"{namespace}/{name}")
        return clone(obj) if obj is not None else None

    def allocate_claim(self, namespace: str, name: str, node: str, results: list[Obj],
                       config: list[Obj] | None = None) -> Obj:
        """What the scheduler writes (recorded shape): the finalizer, then status.allocation and reservedFor."""
        def change(claim: Obj) -> Obj:
            claim["metadata"]["finalizers"] = ["resource.kubernetes.io/delete-protection"]
            allocation: Obj = {"devices": {"results": results}}
            if config:
                allocation["devices"]["config"] = config
            allocation["nodeSelector"] = {"nodeSelectorTerms": [{"matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [node]}]}]}
            allocation["allocationTimestamp"] = now()
            claim["status"] = {"allocation": allocation}
            return claim
        return clone(self._update("resourceclaims", f"{namespace}/{name}", change))

    def delete_claim(self, namespace: str, name: str) -> Obj:
        return clone(self._delete("resourceclaims", f"{namespace}/{name}"))

    def delete_slice(self, name: str) -> Obj:
        return clone(self._delete("resourceslices", name))

    # -- routing ---------------------------------------------------------------------------------------------

    def _route(self, h: Any, method: str, path: str, query: dict[str, str], body: bytes) -> None:
        parts = path.strip("/").split("/")
        if parts[:3] != ["apis", "resource.k8s.io", "v1"]:
            super()._route(h, method, path, query, body)
            return
        rest = parts[3:]
        namespace = None
        if rest[:1] == ["namespaces"] and len(rest) >= 3:
            namespace, rest = rest[1], rest[2:]
        if not rest or rest[0] not in KINDS:
            raise ApiError(no_resource())
        if rest[0] in NAMESPACED:
            if namespace is None and not (len(rest) == 1 and method == "GET"):  # only a list spans namespaces
                raise ApiError(no_resource())
        elif namespace is not None:
            raise ApiError(no_resource())
        resource, rest = rest[0], rest[1:]
        if not rest:
            if method == "GET":
                self._list_or_watch(h, resource, namespace, query)
            elif method == "POST":
                obj = decode_body(body)
                if not isinstance(obj, dict):
                    raise ApiError(bad_request("the body of the request was in an unknown format"))
                if namespace:
                    obj.setdefault("metadata", {})["namespace"] = namespace
                h.send_json(201, self._create_object(resource, obj))
            elif method == "DELETE":
                selector = self._selector(resource, namespace, query)
                with self._cond:
                    doomed = [k for k, o in self._store[resource].items() if selector.matches(o)]
                    for k in doomed:
                        self._delete(resource, k)
                h.send_json(200, status_success())
            else:
                raise ApiError(method_not_allowed())
            return
        name, sub = rest[0], rest[1:]
        key = f"{namespace}/{name}" if namespace else name
        if sub not in ([], ["status"]):
            raise ApiError(no_resource())
        if method == "GET":
            h.send_json(200, self._get(resource, key, name))
        elif method == "PUT":
            h.send_json(200, self._replace(resource, key, name, decode_body(body), "status" if sub else None))
        elif method == "DELETE" and not sub:
            try:
                gone = self._delete(resource, key)
            except KeyError:
                raise ApiError(not_found(f"{resource}.resource.k8s.io", name)) from None
            h.send_json(200, gone)
        else:
            raise ApiError(method_not_allowed())

    # -- objects ---------------------------------------------------------------------------------------------

    def _selector(self, resource: str, namespace: str | None, query: dict[str, str]) -> Selector:
        if resource not in KINDS:
            return super()._selector(resource, namespace, query)
        labels = parse_label_selector(query.get("labelSelector", ""))
        fields = []
        for raw in filter(None, (p.strip() for p in query.get("fieldSelector", "").split(","))):
            path, op, value = raw.partition("!=") if "!=" in raw else raw.partition("=")
            path = path.rstrip("=")
            value = value.lstrip("=")
            if path not in FIELDS[resource]:
                raise ApiError(bad_request(f'"{path}" is not a known field selector: only '
                                           f'"{", ".join(FIELDS[resource])}"'))
            fields.append(FieldReq(path, op != "!=", value))
        return Selector(namespace, tuple(labels), tuple(fields))

    def _list(self, resource: str, selector: Selector, query: dict[str, str]) -> Obj:
        out = super()._list(resource, selector, query)
        if resource in KINDS:
            out["kind"], out["apiVersion"] = f"{KINDS[resource]}List", GROUP_VERSION
        return out

    def _create_object(self, resource: str, obj: Obj) -> Obj:
        meta_in = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
        name = meta_in.get("name") or ""
        if not name and meta_in.get("generateName"):
            # as the apiserver does (k8s.io/apiserver/pkg/storage/names): at most 58 characters of the prefix
            name = meta_in["generateName"][:58] + "".join(self._rng.choice(_SUFFIX) for _ in range(5))
        kind = KINDS[resource]
        if not name:
            raise ApiError(invalid(kind, "", [("FieldValueRequired", "metadata.name",
                                               "Required value: name or generateName is required")]))
        if resource == "resourceslices":
            self._check_slice(name, obj.get("spec"))
            obj = {**obj, "spec": self._drop_disabled(obj.get("spec"))}
        meta: Obj = {"name": name}
        if meta_in.get("generateName"):
            meta["generateName"] = meta_in["generateName"]
        if resource in NAMESPACED:
            meta["namespace"] = meta_in.get("namespace") or "default"
        meta["uid"] = meta_in.get("uid") or f"{self._rng.getrandbits(128):032x}"
        meta["resourceVersion"] = "0"
        if resource != "resourceclaims":
            meta["generation"] = 1
        meta["creationTimestamp"] = now()
        for k, v in meta_in.items():
            if k not in meta and k not in ("resourceVersion", "generation", "uid", "creationTimestamp"):
                meta[k] = v
        new: Obj = {"kind": kind, "apiVersion": GROUP_VERSION, "metadata": meta, "spec": clone(obj.get("spec") or {})}
        if resource == "resourceclaims":
            new["status"] = {}
        key = f"{meta['namespace']}/{name}" if resource in NAMESPACED else name
        with self._cond:
            if key in self._store[resource]:
                raise ApiError({**conflict(f"{resource}.resource.k8s.io", name, "already exists"),
                                "reason": "AlreadyExists",
                                "message": f'{resource}.resource.k8s.io "{name}" already exists'})
            new["metadata"]["resourceVersion"] = str(self._next_rv())
            self._store[resource][key] = new
            self._record(resource, "ADDED", new, None)
        return clone(new)

    def _replace(self, resource: str, key: str, name: str, obj: Any, sub: str | None) -> Obj:
        if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict):
            raise ApiError(bad_request("the body of the request was in an unknown format"))
        if obj["metadata"].get("name") != name:
            raise ApiError(bad_request(f"the name of the object ({obj['metadata'].get('name')}) does not match "
                                       f"the name on the URL ({name})"))
        kind = KINDS[resource]
        with self._cond:
            old = self._store[resource].get(key)
            if old is None:
                raise ApiError(not_found(f"{resource}.resource.k8s.io", name))
            want_rv = obj["metadata"].get("resourceVersion")
            if want_rv and want_rv != old["metadata"]["resourceVersion"]:
                raise ApiError(conflict(f"{resource}.resource.k8s.io", name, "the object has been modified; please "
                                        "apply your changes to the latest version and try again"))
            new = clone(old)
            if sub == "status":
                new["status"] = clone(obj.get("status") or {})
            else:
                spec = obj.get("spec") or {}
                if resource == "resourceslices":
                    self._check_slice(name, spec)
                    spec = self._drop_disabled(spec)
                    for fixed, path in (("driver", "spec.driver"), ("nodeName", "spec.nodeName")):
                        if spec.get(fixed) != old["spec"].get(fixed):
                            raise ApiError(invalid(kind, name, [("FieldValueInvalid", path,
                                                                 "Invalid value: field is immutable")]))
                    if (spec.get("pool") or {}).get("name") != old["spec"]["pool"]["name"]:
                        raise ApiError(invalid(kind, name, [("FieldValueInvalid", "spec.pool.name",
                                                             "Invalid value: field is immutable")]))
                if spec != old["spec"] and "generation" in new["metadata"]:
                    new["metadata"]["generation"] += 1
                new["spec"] = clone(spec)
                for field in ("labels", "annotations", "finalizers", "ownerReferences"):
                    if field in obj["metadata"]:
                        new["metadata"][field] = clone(obj["metadata"][field])
                    else:
                        new["metadata"].pop(field, None)
            if new == old:
                return old
            return clone(self._put(resource, key, new, old))

    def _drop_disabled(self, spec: Any) -> Any:
        if self.capacity != "off" or not isinstance(spec, dict) or not spec.get("devices"):
            return spec
        spec = clone(spec)
        for d in spec["devices"]:
            d.pop("allowMultipleAllocations", None)
            for c in (d.get("capacity") or {}).values():
                c.pop("requestPolicy", None)
        return spec

    def _check_slice(self, name: str, spec: Any) -> None:
        """The apiserver's validation of the limits recorded in kube-apiserver-dra/status-invalid-*.json."""
        kind = "ResourceSlice"
        if not isinstance(spec, dict):
            raise ApiError(invalid(kind, name, [("FieldValueRequired", "spec", "Required value")]))
        if "devices" in spec and "sharedCounters" in spec:
            raise ApiError(invalid(kind, name, [("FieldValueInvalid", "spec", 'Invalid value: "": only one of '
                                                 "`sharedCounters` or `devices` is allowed")]))
        devices = spec.get("devices") or []
        limit = 64 if any(d.get("consumesCounters") or d.get("taints") for d in devices) else 128
        if len(devices) > limit:
            raise ApiError(invalid(kind, name, [("FieldValueTooMany", "spec.devices",
                                                 f"Too many: {len(devices)}: must have at most {limit} items")]))
        for i, d in enumerate(devices):
            consumes = d.get("consumesCounters") or []
            if len(consumes) > 2:
                raise ApiError(invalid(kind, name, [("FieldValueTooMany", f"spec.devices[{i}].consumesCounters",
                                                     f"Too many: {len(consumes)}: must have at most 2 items")]))
            seen: set[str] = set()
            for j, c in enumerate(consumes):
                if c.get("counterSet") in seen:
                    raise ApiError(invalid(kind, name, [("FieldValueDuplicate",
                                                         f"spec.devices[{i}].consumesCounters[{j}]",
                                                         f'Duplicate value: "{c.get("counterSet")}"')]))
                seen.add(c.get("counterSet"))
            multi = d.get("allowMultipleAllocations") is True
            if multi and self.capacity == "invalid":
                where = f"spec.devices[{i}].allowMultipleAllocations"
                raise ApiError(invalid(kind, name, [("FieldValueForbidden", where,
                                                     "Forbidden: not supported by this API server")]))
            for cname, cap in (d.get("capacity") or {}).items():
                problem = _capacity_problem(cap, multi)
                if problem:
                    raise ApiError(invalid(kind, name, [("FieldValueInvalid",
                                                         f"spec.devices[{i}].capacity[{cname}].{problem[0]}",
                                                         problem[1])]))
        for fld in ("driver", "nodeName"):
            if not isinstance(spec.get(fld), str) or not spec[fld]:
                raise ApiError(invalid(kind, name, [("FieldValueRequired", f"spec.{fld}", "Required value")]))
        pool = spec.get("pool") or {}
        if not pool.get("name") or not isinstance(pool.get("resourceSliceCount"), int) or \
                pool["resourceSliceCount"] <= 0:
            raise ApiError(invalid(kind, name, [("FieldValueRequired", "spec.pool", "Required value")]))



def _capacity_problem(cap: Any, multi: bool) -> tuple[str, str] | None:
    """(field, message) of the first rule of validation.go's capacity checks that `cap` breaks, else None."""
    def q(v: Any) -> Decimal:
        try:
            return parse_quantity(str(v))
        except QuantityError:
            return Decimal("NaN")

    if not isinstance(cap, dict) or "value" not in cap:
        return ("value", "Required value")
    policy = cap.get("requestPolicy")
    if policy is None:
        return None
    if not multi:
        return ("requestPolicy", "Forbidden: allowMultipleAllocations must be true")
    value = q(cap["value"])
    values, rng = policy.get("validValues"), policy.get("validRange")
    if values and rng is not None:
        return ("requestPolicy", 'Forbidden: exactly one policy can be specified, cannot specify "validValues" and '
                                 '"validRange" at the same time')
    if not values and rng is None:
        return None
    if "default" not in policy:
        return ("requestPolicy.default", "Required value")
    default = q(policy["default"])
    if values:
        qs = [q(v) for v in values]
        if len(qs) > 10:
            return ("requestPolicy.validValues", f"Too many: {len(qs)}: must have at most 10 items")
        if qs != sorted(qs):
            return ("requestPolicy.validValues", "values must be sorted in ascending order")
        if any(v > value for v in qs):
            return ("requestPolicy.validValues", "option is larger than capacity value")
        if default not in qs:
            return ("requestPolicy.validValues", "default value is not valid according to the requestPolicy")
        return None
    if "min" not in rng:
        return ("requestPolicy.validRange.min", "Required value")
    low = q(rng["min"])
    if low > value:
        return ("requestPolicy.validRange.min", "min is larger than capacity value")
    if default < low:
        return ("requestPolicy.validRange.min", "default is less than min")
    if "max" in rng:
        high = q(rng["max"])
        if low > high or high > value or default > high:
            return ("requestPolicy.validRange.max", "min/default above max, or max above the capacity value")
    if "step" in rng:
        step = q(rng["step"])
        if low + step > value:
            return ("requestPolicy.validRange.step", "one step is larger than capacity value")
        for v in [default] + ([q(rng["max"])] if "max" in rng else []):
            if (v - low) % step != 0:
                return ("requestPolicy.validRange.step", "value is not a multiple of a given step")
    return None
