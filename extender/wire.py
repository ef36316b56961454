"""Reading request bodies on the hot path: orjson into dicts, then only the fields the verbs need, shape-checked.

The checks enforce exactly the shapes extender.http.models publishes (the declared fields of Pod and Node objects:
metadata strings and string maps, spec/status objects; every other key is free), so a body that breaks the
published schema is a BadRequest (HTTP 400) naming the field, and one that keeps it is answered 200. What lies
deeper (containers, quantities, annotations' meaning) is judged by the verbs and answered in the body.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from extender.binder import BindRequest
from extender.http import bodies
from extender.http.bodies import BadRequest, BodyTooLarge
from extender.preempt import NodeVictims, Victim
from gputopo.contract import PlanFormatError, parse_plan

__all__ = ["BadRequest", "BodyTooLarge", "decode"]  # re-exported: the verbs' errors and decoder

INT32_MAX = 2**31 - 1  # NumPDBViolations is an int32 in kube-scheduler


def _type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {dict: "object", list: "array", str: "string", int: "integer", float: "number"}.get(
        type(value), type(value).__name__)


def _object(data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise BadRequest(f"{what} must be a JSON object, got {_type(data)}")
    return data


def _opt(data: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = data.get(key)
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
        raise BadRequest(f"{where}.{key} must be {_NAMES[kind]} or null, got {_type(value)}")
    return value


_NAMES = {str: "a string", dict: "an object", list: "an array", int: "an integer"}


def _string_map(data: dict[str, Any], key: str, where: str) -> None:
    value = _opt(data, key, dict, where)
    if value:
        for k, v in value.items():
            if not isinstance(v, str):
                raise BadRequest(f"{where}.{key}[{k!r}] must be a string, got {_type(v)}")


def check_object(obj: Any, where: str, *, required_name: str | None = None) -> dict[str, Any]:
    """A Pod or Node: the fields extender.http.models declares must have their types; other keys are free.
    `required_name` names a metadata key that must be a non-empty string (Node: name, victim Pod: uid)."""
    obj = _object(obj, where)
    _opt(obj, "apiVersion", str, where)
    _opt(obj, "kind", str, where)
    _opt(obj, "spec", dict, where)
    _opt(obj, "status", dict, where)
    meta = obj.get("metadata")
    if meta is None and required_name is None:
        return obj
    meta = _object(meta, f"{where}.metadata")
    mw = f"{where}.metadata"
    for key in ("name", "namespace", "uid", "deletionTimestamp"):
        _opt(meta, key, str, mw)
    _string_map(meta, "annotations", mw)
    _string_map(meta, "labels", mw)
    if required_name is not None:
        value = meta.get(required_name)
        if not isinstance(value, str) or not value:
            raise BadRequest(f"{mw}.{required_name} must be a non-empty string")
    return obj


# The last NodeNames lists found to be strings without repeats: kube-scheduler sends the same lists pod after pod
# (filter's, then prioritize's), and checking 5,000 names took a sixth of a filter (issue 24). An equal list is
# answered with the kept object, so the verbs' own comparisons with their last answers (extender.placement.memo)
# meet the same strings and compare pointers. Replaced whole, never changed: no lock needed.
LAST_NAME_LISTS = 8
_last_names: list[list[str]] = []

# The JSON text of those lists too, as it ends a body: kube-scheduler (Go's encoding/json) writes its ExtenderArgs
# fields in order, so NodeNames comes last, `"NodeNames":[...]}`, and a body whose array is byte for byte a kept
# list's text is decoded without it (decode), then handed the kept list: at 5,000 nodes, parsing the names and
# comparing them with the kept lists was a fifth of the pair (issue 24). Prioritize's array is filter's answer, so
# filter's passed list is kept with the text it was written as. Replaced whole, never changed.
_NAMES_KEY = b'"NodeNames":['
_last_texts: dict[bytes, list[str]] = {}
_read: tuple[bytes, Any] | None = None  # the last body's NodeNames text and the list decoded from it


def _names_text(body: bytes) -> tuple[int, bytes] | None:
    """(where the NodeNames value starts, its text) when the body ends with a NodeNames array; else None."""
    end = len(body)
    while end and body[end - 1] in b" \t\r\n":
        end -= 1
    if end < 2 or body[end - 2:end] != b"]}":
        return None
    at = body.rfind(_NAMES_KEY, 0, end)
    if at < 0:
        return None
    start = at + len(_NAMES_KEY) - 1
    return start, body[start:end - 1]


def decode(body: bytes) -> Any:
    """The body's JSON value, as bodies.decode; a trailing NodeNames array that is a kept list's text is not parsed:
    the rest is, with null in its place (the same document otherwise, so the same errors), then the kept list is
    put there. The spliced document ends `"NodeNames":null}`, so that null is the root object's last member."""
    global _read
    found = _names_text(body)
    if found is not None:
        start, text = found
        kept = _last_texts.get(text)
        if kept is not None:
            data = bodies.decode(body[:start] + b"null}")
            if isinstance(data, dict) and "NodeNames" in data and data["NodeNames"] is None:
                data["NodeNames"] = kept
                return data
    data = bodies.decode(body)
    _read = (found[1], data.get("NodeNames")) if found is not None and isinstance(data, dict) else None
    return data


def known_valid(names: list[str], *, written: bool = False) -> None:
    """A list made from a valid one (filter's passed nodes, which kube-scheduler sends back to prioritize): kept as
    if it had been checked; `written`: it goes out in an answer, so its JSON text is kept too. The caller never
    changes it."""
    global _last_names, _last_texts
    _last_names = [names, *_last_names[:LAST_NAME_LISTS - 1]]
    text = None
    if written:
        if not any(n is names for n in _last_texts.values()):
            text = orjson.dumps(names)
    else:
        read = _read
        text = read[0] if read is not None and read[1] is names else None
    if text is not None:
        kept = {t: n for t, n in _last_texts.items() if any(n is m for m in _last_names)}
        kept[text] = names
        _last_texts = kept


@dataclass
class ExtenderArgs:
    pod: dict[str, Any]
    names: list[str]  # the nodes to judge, in request order
    node_names: list[str] | None  # as sent (nodeCacheCapable)
    nodes: dict[str, Any] | None  # the NodeList as sent (not nodeCacheCapable)
    items: list[dict[str, Any]] | None


def extender_args(data: Any) -> ExtenderArgs:
    """Body of /filter and /prioritize."""
    data = _object(data, "body")
    if "Pod" not in data:
        raise BadRequest("Pod is missing")
    pod = check_object(data["Pod"], "Pod")
    node_names = data.get("NodeNames")
    nodes = data.get("Nodes")
    if node_names is None and nodes is None:
        node_names = []  # nothing to judge: answered as an empty nodeCacheCapable request
    items: list[dict[str, Any]] | None = None
    names: list[str] = []
    if node_names is not None:
        global _last_names
        names = node_names
        if not isinstance(node_names, list):
            raise BadRequest("NodeNames must be an array of strings or null")
        kept = _last_names
        known = next((seen for seen in kept if seen == node_names), None)  # C-level compares
        if known is not None:  # a list that passed before: strings, none twice; the same object each time
            names = known
            if kept[0] is not known:
                _last_names = [known, *(seen for seen in kept if seen is not known)]
        else:
            if not set(map(type, node_names)) <= {str}:
                raise BadRequest("NodeNames must be an array of strings or null")
            if len(set(node_names)) < len(node_names):  # a name sent twice is judged, and answered, once
                names = list(dict.fromkeys(node_names))
            else:
                known_valid(node_names)
    if nodes is not None:
        nodes = _object(nodes, "Nodes")
        _opt(nodes, "apiVersion", str, "Nodes")
        _opt(nodes, "kind", str, "Nodes")
        _opt(nodes, "metadata", dict, "Nodes")
        items = _opt(nodes, "items", list, "Nodes") or []
        list_names = [check_object(item, f"Nodes.items[{i}]", required_name="name")["metadata"]["name"]
                      for i, item in enumerate(items)]
        if len(set(list_names)) < len(list_names):  # a node listed twice is judged, and echoed back, once
            first: dict[str, int] = {}
            for i, name in enumerate(list_names):
                first.setdefault(name, i)
            items = [items[i] for i in first.values()]
            list_names = list(first)
        if node_names is None:
            names = list_names
    return ExtenderArgs(pod, names, node_names, nodes, items)


def binding_args(data: Any) -> BindRequest:
    data = _object(data, "body")
    values = {}
    for key in ("PodName", "PodNamespace", "Node"):
        v = data.get(key)
        if not isinstance(v, str) or not v:
            raise BadRequest(f"{key} must be a non-empty string, got {_type(v)}")
        values[key] = v
    uid = data.get("PodUID")
    if not isinstance(uid, str):
        raise BadRequest(f"PodUID must be a string, got {_type(uid)}")
    return BindRequest(values["PodName"], values["PodNamespace"], uid, values["Node"])


@dataclass
class PreemptionArgs:
    pod: dict[str, Any]
    candidates: dict[str, NodeVictims]


def _pdb(v: dict[str, Any], where: str) -> int:
    if "NumPDBViolations" not in v:
        return 0
    value = v["NumPDBViolations"]
    if isinstance(value, float) and value.is_integer():
        value = int(value)  # JSON Schema's integer includes 2.0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT32_MAX:
        raise BadRequest(f"{where}.NumPDBViolations must be an integer in 0..{INT32_MAX}, got {value!r}")
    return value


def _victim_plan(pod: dict[str, Any], plan_key: str) -> Any:
    text = (pod["metadata"].get("annotations") or {}).get(plan_key)
    if text is None:
        return None
    try:
        return parse_plan(text)
    except PlanFormatError:
        return None  # someone else's garbage: this victim frees no known GPUs


def _priority(pod: dict[str, Any]) -> int:
    """spec.priority as kube-scheduler reads it (corev1helpers.PodPriority): 0 when unset."""
    value = (pod.get("spec") or {}).get("priority")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def preemption_args(data: Any, plan_key: str) -> PreemptionArgs:
    """Body of /preempt; full-pod victims carry their plan annotation, meta victims only a UID."""
    data = _object(data, "body")
    if "Pod" not in data:
        raise BadRequest("Pod is missing")
    pod = check_object(data["Pod"], "Pod")
    candidates: dict[str, NodeVictims] = {}
    meta = data.get("NodeNameToMetaVictims")
    full = data.get("NodeNameToVictims")
    if meta is not None:
        for node, v in _object(meta, "NodeNameToMetaVictims").items():
            where = f"NodeNameToMetaVictims[{node}]"
            v = _object(v, where)
            victims = []
            for i, p in enumerate(_opt(v, "Pods", list, where) or []):
                uid = _object(p, f"{where}.Pods[{i}]").get("UID")
                if not isinstance(uid, str):
                    raise BadRequest(f"{where}.Pods[{i}].UID must be a string, got {_type(uid)}")
                victims.append(Victim(uid, None))
            candidates[node] = NodeVictims(tuple(victims), _pdb(v, where))
    if full is not None:
        for node, v in _object(full, "NodeNameToVictims").items():
            where = f"NodeNameToVictims[{node}]"
            v = _object(v, where)
            victims = []
            for i, p in enumerate(_opt(v, "Pods", list, where) or []):
                p = check_object(p, f"{where}.Pods[{i}]", required_name="uid")
                victims.append(Victim(p["metadata"]["uid"], _victim_plan(p, plan_key), _priority(p)))
            candidates[node] = NodeVictims(tuple(victims), _pdb(v, where))
    return PreemptionArgs(pod, candidates)
