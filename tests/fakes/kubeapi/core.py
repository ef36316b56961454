"""The core/v1 API: Nodes, Pods, pods/binding and namespaced Bindings, pods/status and nodes/status; get, create,
patch (merge, strategic-merge, JSON), delete; with the apiserver's defaulting, validation and update rules."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson

from tests.fakes.kubeapi.listwatch import ListWatch
from tests.fakes.kubeapi.objects import Obj, clone, now
from tests.fakes.kubeapi.patches import PATCH_TYPES, go_repr, go_type, json_patch, merge_patch, shape_ok
from tests.fakes.kubeapi.selectors import LABEL_VALUE_MSG, check_key, check_value
from tests.fakes.kubeapi.status import (
    ApiError,
    bad_request,
    conflict,
    invalid,
    method_not_allowed,
    no_resource,
    not_found,
    status_failure,
    status_success,
    unprocessable,
)

if TYPE_CHECKING:
    from tests.fakes.kubeapi.transport import Handler

ANNOTATIONS_MAX_BYTES = 262144
_POD_MUTABLE_SPEC = ("containers", "initContainers", "activeDeadlineSeconds", "tolerations",
                     "terminationGracePeriodSeconds")


class CoreV1(ListWatch):
    """Nodes and Pods on the store (see the module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        for resource in ("nodes", "pods"):
            self._store[resource] = {}

    # -- test-facing state -----------------------------------------------------------------------------------

    def add_node(self, obj: Obj) -> Obj:
        return clone(self._create("nodes", obj))

    def add_pod(self, obj: Obj) -> Obj:
        return clone(self._create("pods", obj))

    def update_node(self, name: str, change: Obj | Callable[[Obj], Obj | None]) -> Obj:
        """Apply a merge-patch dict, or a function that edits (or returns) a copy of the node."""
        return clone(self._update("nodes", name, change))

    def update_pod(self, namespace: str, name: str, change: Obj | Callable[[Obj], Obj | None]) -> Obj:
        return clone(self._update("pods", f"{namespace}/{name}", change))

    def delete_node(self, name: str) -> Obj:
        return clone(self._delete("nodes", name))

    def delete_pod(self, namespace: str, name: str) -> Obj:
        return clone(self._delete("pods", f"{namespace}/{name}"))

    def node(self, name: str) -> Obj | None:
        with self._cond:
            obj = self._store["nodes"].get(name)
        return clone(obj) if obj is not None else None

    def pod(self, namespace: str, name: str) -> Obj | None:
        with self._cond:
            obj = self._store["pods"].get(f"{namespace}/{name}")
        return clone(obj) if obj is not None else None

    def nodes(self) -> list[Obj]:
        with self._cond:
            return [clone(o) for _, o in sorted(self._store["nodes"].items())]

    def pods(self) -> list[Obj]:
        with self._cond:
            return [clone(o) for _, o in sorted(self._store["pods"].items())]

    # -- objects ---------------------------------------------------------------------------------------------

    def _normalise(self, resource: str, obj: Obj) -> Obj:
        if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict):
            raise ValueError("object needs a metadata dict")
        src = clone(obj)
        meta_in = src.pop("metadata")
        name = meta_in.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError("object needs metadata.name")
        meta: Obj = {"name": name}
        if resource == "pods":
            meta["namespace"] = meta_in.get("namespace") or "default"
        meta["uid"] = meta_in.get("uid") or str(uuid.uuid4())
        meta["resourceVersion"] = "0"
        if resource == "pods":
            meta["generation"] = meta_in.get("generation", 1)
        meta["creationTimestamp"] = meta_in.get("creationTimestamp") or now()
        for k, v in meta_in.items():
            if k not in meta and k not in ("resourceVersion", "generation"):
                meta[k] = v
        out: Obj = {"kind": "Node" if resource == "nodes" else "Pod", "apiVersion": "v1", "metadata": meta}
        src.pop("kind", None)
        src.pop("apiVersion", None)
        out["spec"] = src.pop("spec", None) or ({} if resource == "nodes" else {"containers": []})
        status = src.pop("status", None) or {}
        if resource == "pods":
            status.setdefault("phase", "Pending")
        out["status"] = status
        out.update(src)
        return out

    def _create(self, resource: str, obj: Obj) -> Obj:
        new = self._normalise(resource, obj)
        key = _key(resource, new)
        with self._cond:
            if key in self._store[resource]:
                raise ApiError(status_failure(409, "AlreadyExists", f'{resource} "{new["metadata"]["name"]}" '
                                              "already exists",
                                              {"name": new["metadata"]["name"], "kind": resource}))
            new["metadata"]["resourceVersion"] = str(self._next_rv())
            self._store[resource][key] = new
            self._record(resource, "ADDED", new, None)
        return new

    # -- routes ----------------------------------------------------------------------------------------------

    def _route(self, h: Handler, method: str, path: str, query: dict[str, str], body: bytes) -> None:
        parts = path.strip("/").split("/")
        if parts == ["version"] and method == "GET":
            h.send_json(200, {"major": "1", "minor": "36", "gitVersion": "v1.36.2-fake", "platform": "linux/amd64"})
            return
        if len(parts) < 3 or parts[:2] != ["api", "v1"]:
            raise ApiError(no_resource())
        rest = parts[2:]
        if rest[0] == "nodes":
            resource, namespace, rest = "nodes", None, rest[1:]
        elif rest[0] == "pods" and len(rest) == 1:
            resource, namespace, rest = "pods", None, []
        elif rest[0] == "namespaces" and len(rest) >= 3 and rest[2] in ("pods", "bindings"):
            if rest[2] == "bindings" and len(rest) == 3:
                self._allow(method, "POST")
                self._bind(h, rest[1], None, body)
                return
            if rest[2] != "pods":
                raise ApiError(no_resource())
            resource, namespace, rest = "pods", rest[1], rest[3:]
        else:
            raise ApiError(no_resource())
        if not rest:
            if method == "GET":
                self._list_or_watch(h, resource, namespace, query)
            elif method == "POST" and (resource == "nodes" or namespace):
                self._create_http(h, resource, namespace, body)
            else:
                raise ApiError(method_not_allowed())
            return
        name, sub = rest[0], rest[1:]
        key = name if resource == "nodes" else f"{namespace}/{name}"
        if not sub:
            if method == "GET":
                h.send_json(200, self._get(resource, key, name))
            elif method == "PATCH":
                self._patch(h, resource, key, name, None, body)
            elif method == "DELETE":
                self._delete_http(h, resource, key, name)
            else:
                raise ApiError(method_not_allowed())
        elif sub == ["status"]:
            if method == "GET":
                h.send_json(200, self._get(resource, key, name))
            elif method == "PATCH":
                self._patch(h, resource, key, name, "status", body)
            else:
                raise ApiError(method_not_allowed())
        elif sub == ["binding"] and resource == "pods":
            self._allow(method, "POST")
            self._bind(h, namespace or "", name, body)
        else:
            raise ApiError(no_resource())

    @staticmethod
    def _allow(method: str, allowed: str) -> None:
        if method != allowed:
            raise ApiError(method_not_allowed())

    def _create_http(self, h: Handler, resource: str, namespace: str | None, body: bytes) -> None:
        obj = decode_body(body)
        if not isinstance(obj, dict):
            raise ApiError(bad_request("the body of the request was in an unknown format"))
        meta = obj.setdefault("metadata", {})
        if namespace:
            if meta.get("namespace") not in (None, namespace):
                raise ApiError(bad_request("the namespace of the provided object does not match the namespace "
                                           "sent on the request"))
            meta["namespace"] = namespace
        try:
            new = self._create(resource, obj)
        except ValueError as exc:
            raise ApiError(invalid("Node" if resource == "nodes" else "Pod", str(meta.get("name", "")),
                                   [("FieldValueRequired", "metadata.name", f"Required value: {exc}")])) from exc
        h.send_json(201, new)

    def _delete_http(self, h: Handler, resource: str, key: str, name: str) -> None:
        try:
            gone = self._delete(resource, key)
        except KeyError:
            raise ApiError(not_found(resource, name)) from None
        if resource == "pods":
            h.send_json(200, gone)
        else:
            h.send_json(200, status_success(200, {"name": name, "kind": resource,
                                                  "uid": gone["metadata"]["uid"]}))

    def _patch(self, h: Handler, resource: str, key: str, name: str, sub: str | None, body: bytes) -> None:
        ctype = (h.headers.get("Content-Type") or "").split(";")[0].strip().lower()
        if ctype not in PATCH_TYPES:
            raise ApiError(status_failure(415, "UnsupportedMediaType", "415: Unsupported Media Type", {}))
        try:
            patch = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            truncated = "unexpected end" in str(exc) or "zero-length" in str(exc)
            msg = "unexpected end of JSON input" if truncated else str(exc)
            raise ApiError(bad_request(f"error decoding patch: {msg}")) from None
        kind = "Node" if resource == "nodes" else "Pod"
        with self._cond:
            old = self._store[resource].get(key)
            if old is None:
                raise ApiError(not_found(resource, name))
            if ctype == "application/json-patch+json":
                if not isinstance(patch, list):
                    raise ApiError(bad_request(
                        f"json: cannot unmarshal {type(patch).__name__} into Go value of type jsonpatch.Patch"))
                try:
                    new = json_patch(old, patch)
                except ValueError as exc:
                    raise ApiError(unprocessable(str(exc))) from None
            else:
                if not isinstance(patch, dict) or not shape_ok(patch):
                    raise ApiError(status_failure(
                        422, "Invalid",
                        f' "" is invalid: patch: Invalid value: "{go_repr(patch)}": cannot restore map from '
                        f"{go_type(patch)}",
                        {"causes": [{"reason": "FieldValueInvalid",
                                     "message": f'Invalid value: "{go_repr(patch)}": cannot restore map',
                                     "field": "patch"}]}))
                pmeta = patch.get("metadata") if isinstance(patch.get("metadata"), dict) else {}
                want_rv = pmeta.get("resourceVersion")
                if want_rv is not None and want_rv != old["metadata"]["resourceVersion"]:
                    raise ApiError(conflict(resource, name, "the object has been modified; please apply your "
                                            "changes to the latest version and try again"))
                want_uid = pmeta.get("uid")
                if want_uid is not None and want_uid != old["metadata"]["uid"]:
                    raise ApiError(conflict(resource, name, f"Precondition failed: UID in precondition: "
                                            f"{want_uid}, UID in object meta: {old['metadata']['uid']}"))
                new = merge_patch(old, patch)
            new = self._settle(resource, kind, name, old, new, sub)
            if new == old:
                result = old
            else:
                result = self._put(resource, key, new, old)
        h.send_json(200, result)

    def _settle(self, resource: str, kind: str, name: str, old: Obj, new: Obj, sub: str | None) -> Obj:
        """Keep server-owned fields, apply subresource rules, validate: like the apiserver's update strategy."""
        if not isinstance(new, dict) or not isinstance(new.get("metadata"), dict):
            raise ApiError(invalid(kind, name, [("FieldValueRequired", "metadata", "Required value")]))
        if new["metadata"].get("name") != name:
            raise ApiError(bad_request(f"the name of the object ({new['metadata'].get('name')}) does not match "
                                       f"the name on the URL ({name})"))
        if sub == "status":
            settled = dict(old)
            settled["status"] = new.get("status") or {}
        else:
            settled = dict(new)
            settled["status"] = old.get("status", {})
            meta = dict(new["metadata"])
            for fixed in ("uid", "resourceVersion", "creationTimestamp", "namespace", "generation"):
                if fixed in old["metadata"]:
                    meta[fixed] = old["metadata"][fixed]
            settled["metadata"] = meta
            settled["kind"], settled["apiVersion"] = old["kind"], old["apiVersion"]
        causes = validate_metadata(kind, settled)
        if causes:
            raise ApiError(invalid(kind, name, causes))
        if resource == "pods" and sub is None:
            old_spec = {k: v for k, v in (old.get("spec") or {}).items() if k not in _POD_MUTABLE_SPEC}
            new_spec = {k: v for k, v in (settled.get("spec") or {}).items() if k not in _POD_MUTABLE_SPEC}
            if old_spec != new_spec:
                msg = ("Forbidden: pod updates may not change fields other than `spec.containers[*].image`,"
                       "`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only "
                       "additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be "
                       "set to 1 if it was previously negative)")
                raise ApiError(invalid(kind, name, [("FieldValueForbidden", "spec", msg)]))
        return settled

    def _bind(self, h: Handler, namespace: str, name: str | None, body: bytes) -> None:
        binding = decode_body(body)
        if not isinstance(binding, dict):
            raise ApiError(bad_request("the body of the request was in an unknown format"))
        meta = binding.get("metadata") if isinstance(binding.get("metadata"), dict) else {}
        if name is None:  # POST .../bindings: the pod is named in the Binding
            name = meta.get("name") or ""
        elif meta.get("name") != name:
            raise ApiError(bad_request("name in URL does not match name in Binding object"))
        target = binding.get("target") if isinstance(binding.get("target"), dict) else {}
        if target.get("kind") not in (None, "", "Node"):
            raise ApiError(invalid("Binding", name, [("FieldValueNotSupported", "target.kind",
                                                      f'Unsupported value: "{target.get("kind")}": supported '
                                                      'values: "Node", ""')]))
        node = target.get("name")
        if not isinstance(node, str) or not node:
            raise ApiError(invalid("Binding", name, [("FieldValueRequired", "target.name", "Required value")]))
        annotations = meta.get("annotations") or {}
        if not isinstance(annotations, dict) or not all(isinstance(v, str) for v in annotations.values()):
            raise ApiError(invalid("Binding", name, [("FieldValueInvalid", "metadata.annotations",
                                                      "Invalid value: must be a map of strings")]))
        key = f"{namespace}/{name}"
        with self._cond:
            pod = self._store["pods"].get(key)
            if pod is None:
                raise ApiError(not_found("pods", name))
            pmeta = pod["metadata"]
            if meta.get("uid") and meta["uid"] != pmeta["uid"]:
                raise ApiError(conflict("pods/binding", name, f"Precondition failed: UID in precondition: "
                                        f"{meta['uid']}, UID in object meta: {pmeta['uid']}"))
            if meta.get("resourceVersion") and meta["resourceVersion"] != pmeta["resourceVersion"]:
                raise ApiError(conflict("pods/binding", name, "the object has been modified; please apply your "
                                        "changes to the latest version and try again"))
            if pmeta.get("deletionTimestamp"):
                raise ApiError(conflict("pods/binding", name,
                                        f"pod {name} is being deleted, cannot be assigned to a host"))
            bound = (pod.get("spec") or {}).get("nodeName")
            if bound:
                raise ApiError(conflict("pods/binding", name,
                                        f'pod {name} is already assigned to node "{bound}"'))
            if (pod.get("spec") or {}).get("schedulingGates"):
                raise ApiError(conflict("pods/binding", name, f"pod {name} has non-empty .spec.schedulingGates"))
            new = clone(pod)
            new["spec"]["nodeName"] = node
            if annotations:
                new["metadata"].setdefault("annotations", {}).update(annotations)
            conditions = [c for c in new["status"].get("conditions", []) if c.get("type") != "PodScheduled"]
            conditions.insert(0, {"type": "PodScheduled", "status": "True", "lastProbeTime": None,
                                  "lastTransitionTime": now()})
            new["status"]["conditions"] = conditions
            self._put("pods", key, new, pod)
        h.send_json(201, status_success(201))


def _key(resource: str, obj: Obj) -> str:
    meta = obj["metadata"]
    return meta["name"] if resource == "nodes" else f"{meta['namespace']}/{meta['name']}"


def validate_metadata(kind: str, obj: Obj) -> list[tuple[str, str, str]]:
    """Field errors for labels/annotations, worded like the apiserver's."""
    causes: list[tuple[str, str, str]] = []
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        return [("FieldValueInvalid", "metadata", "Invalid value: must be an object")]
    for fld in ("labels", "annotations"):
        values = meta.get(fld)
        if values is None:
            continue
        if not isinstance(values, dict):
            causes.append(("FieldValueInvalid", f"metadata.{fld}", f"Invalid value: {values!r}: must be a map"))
            continue
        for key, value in values.items():
            err = check_key(key)
            if err:
                causes.append(("FieldValueInvalid", f"metadata.{fld}", f'Invalid value: "{key}": {err}'))
            if not isinstance(value, str):
                causes.append(("FieldValueInvalid", f"metadata.{fld}",
                               f"Invalid value: {value!r}: must be a string"))
            elif fld == "labels" and check_value(value):
                causes.append(("FieldValueInvalid", "metadata.labels",
                               f'Invalid value: "{value}": {LABEL_VALUE_MSG}'))
        if fld == "annotations" and not causes:
            size = sum(len(k) + len(v) for k, v in values.items())
            if size > ANNOTATIONS_MAX_BYTES:
                causes.append(("FieldValueTooLong", "metadata.annotations",
                               f"Too long: may not be more than {ANNOTATIONS_MAX_BYTES} bytes"))
    return causes


def decode_body(body: bytes) -> Any:
    """A request body as JSON; one that is not answers 400 with the apiserver's wording."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise ApiError(bad_request(f"couldn't get version/kind; json parse error: {exc}")) from None
