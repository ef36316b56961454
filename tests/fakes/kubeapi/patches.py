"""PATCH bodies: RFC 7386 merge patches (also what strategic-merge patches of metadata amount to) and RFC 6902 JSON
patches, with the apiserver's wording for patches it cannot apply."""

from __future__ import annotations

from typing import Any

from tests.fakes.kubeapi.objects import Obj, clone

PATCH_TYPES = (
    "application/merge-patch+json",
    "application/strategic-merge-patch+json",
    "application/json-patch+json",
)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (returns a new value; inputs are not changed)."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def _pointer(path: Any) -> list[str]:
    if not isinstance(path, str) or (path and not path.startswith("/")):
        raise ValueError(f"invalid JSON pointer {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path.split("/")[1:]] if path else []


def json_patch(doc: Obj, ops: list[Any]) -> Obj:
    """RFC 6902 add/remove/replace/test (on a copy). Raises ValueError with jsonpatch-like messages."""
    doc = clone(doc)
    for op in ops:
        if not isinstance(op, dict) or not isinstance(op.get("op"), str):
            raise ValueError(f"invalid operation {op!r}")
        kind, path = op["op"], op.get("path")
        parts = _pointer(path)
        if not parts:
            raise ValueError(f"jsonpatch {kind} operation does not apply: cannot change the root document")
        parent: Any = doc
        for p in parts[:-1]:
            if isinstance(parent, dict) and p in parent:
                parent = parent[p]
            elif isinstance(parent, list) and p.isdigit() and int(p) < len(parent):
                parent = parent[int(p)]
            else:
                raise ValueError(f"jsonpatch {kind} operation does not apply: doc is missing path: \"{path}\"")
        last = parts[-1]
        if kind in ("add", "replace", "test") and "value" not in op:
            raise ValueError(f"jsonpatch {kind} operation missing value")
        if isinstance(parent, dict):
            exists = last in parent
            if kind == "add":
                parent[last] = op["value"]
            elif not exists:
                raise ValueError(f"jsonpatch {kind} operation does not apply: doc is missing key: {path}")
            elif kind == "replace":
                parent[last] = op["value"]
            elif kind == "remove":
                del parent[last]
            elif kind == "test":
                if parent[last] != op["value"]:
                    raise ValueError(f"testing value {path} failed: test failed")
            else:
                raise ValueError(f"Unexpected kind: {kind}")
        elif isinstance(parent, list):
            if kind == "add" and last == "-":
                parent.append(op["value"])
                continue
            if not last.isdigit() or int(last) > len(parent) or (kind != "add" and int(last) == len(parent)):
                raise ValueError(f"jsonpatch {kind} operation does not apply: doc is missing path: \"{path}\"")
            idx = int(last)
            if kind == "add":
                parent.insert(idx, op["value"])
            elif kind == "replace":
                parent[idx] = op["value"]
            elif kind == "remove":
                del parent[idx]
            elif kind == "test":
                if parent[idx] != op["value"]:
                    raise ValueError(f"testing value {path} failed: test failed")
            else:
                raise ValueError(f"Unexpected kind: {kind}")
        else:
            raise ValueError(f"jsonpatch {kind} operation does not apply: doc is missing path: \"{path}\"")
    return doc


def shape_ok(patch: Obj) -> bool:
    meta = patch.get("metadata")
    if meta is None:
        return True
    if not isinstance(meta, dict):
        return False
    return all(meta.get(f) is None or isinstance(meta.get(f), dict) for f in ("labels", "annotations"))


def go_type(value: Any) -> str:
    meta = value.get("metadata") if isinstance(value, dict) else None
    bad = meta if not isinstance(meta, dict) else next(
        (meta[f] for f in ("labels", "annotations") if meta.get(f) is not None and not isinstance(meta[f], dict)),
        value)
    return {str: "string", int: "int64", float: "float64", bool: "bool", list: "slice"}.get(type(bad), "value")


def go_repr(value: Any) -> str:
    if isinstance(value, dict):
        return "map[" + " ".join(f"{k}:{go_repr(v)}" for k, v in sorted(value.items())) + "]"
    if isinstance(value, list):
        return "[" + " ".join(go_repr(v) for v in value) + "]"
    return "<nil>" if value is None else str(value)
