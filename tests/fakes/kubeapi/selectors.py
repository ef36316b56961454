"""labelSelector and fieldSelector as the apiserver parses them, and its rules for label keys and values (the
same rules validate metadata.labels and metadata.annotations keys on writes)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tests.fakes.kubeapi.objects import Obj
from tests.fakes.kubeapi.status import ApiError, bad_request

_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"
_LABEL_VALUE_RE = re.compile(r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?")
_KEY_NAME_RE = re.compile(_NAME)
_DNS_SUBDOMAIN_RE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LABEL_VALUE_MSG = (
    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must "
    "start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for "
    "validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')"
)
_KEY_MSG = (
    "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an "
    "alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is "
    "'([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')"
)

NODE_FIELDS = ("metadata.name", "spec.unschedulable")
POD_FIELDS = (
    "metadata.name", "metadata.namespace", "spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
    "spec.serviceAccountName", "spec.hostNetwork", "status.phase", "status.podIP", "status.nominatedNodeName",
)


@dataclass(frozen=True)
class LabelReq:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!"
    values: frozenset[str] = frozenset()

    def matches(self, labels: dict[str, str]) -> bool:
        has = self.key in labels
        if self.op == "exists":
            return has
        if self.op == "!":
            return not has
        if self.op in ("=", "in"):
            return has and labels[self.key] in self.values
        return not has or labels[self.key] not in self.values  # "!=" and "notin"


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


def check_key(key: str) -> str | None:
    if not key:
        return "found '', expected: identifier"
    prefix, _, name = key.rpartition("/")
    if "/" in key and (not prefix or len(prefix) > 253 or not _DNS_SUBDOMAIN_RE.fullmatch(prefix)):
        return f"invalid label key \"{key}\": prefix part must be a valid DNS subdomain"
    if not name or len(name) > 63 or not _KEY_NAME_RE.fullmatch(name):
        bad = next((c for c in key if c in "()!=<>"), None)
        if bad:
            return f"found '{bad}', expected: identifier"
        return f"invalid label key \"{key}\": {_KEY_MSG}"
    return None


def check_value(value: str) -> str | None:
    if len(value) > 63 or not _LABEL_VALUE_RE.fullmatch(value):
        bad = next((c for c in value if c in "()!=<>,"), None)
        if bad:
            return f"found '{bad}', expected: identifier"
        return f"invalid label value: \"{value}\": at key: {LABEL_VALUE_MSG}"
    return None


def parse_label_selector(text: str) -> list[LabelReq]:
    """labelSelector grammar: k=v, k==v, k!=v, k, !k, k in (a,b), k notin (a,b); comma means AND."""
    reqs: list[LabelReq] = []
    if not text.strip():
        return reqs
    for raw in _split_top(text):
        part = raw.strip()
        m = re.fullmatch(r"(\S+)\s+(in|notin)\s*\((.*)\)", part)
        if m:
            key, op, vals = m.group(1), m.group(2), [v.strip() for v in m.group(3).split(",")]
            errs = [check_key(key), *(check_value(v) for v in vals)]
        elif part.startswith("!"):
            key, op, vals = part[1:].strip(), "!", []
            errs = [check_key(key)]
        else:
            m = re.fullmatch(r"([^=!\s]*)\s*(==|!=|=)\s*(.*)", part)
            if m:
                key, op, vals = m.group(1), ("=" if m.group(2) == "==" else m.group(2)), [m.group(3).strip()]
                errs = [check_key(key), check_value(vals[0])]
            else:
                key, op, vals = part, "exists", []
                errs = [check_key(key)]
        err = next((e for e in errs if e), None)
        if err:
            raise ApiError(bad_request(f"unable to parse requirement: {err}"))
        reqs.append(LabelReq(key, op, frozenset(vals)))
    return reqs


@dataclass(frozen=True)
class FieldReq:
    path: str
    equal: bool
    value: str


def parse_field_selector(text: str, resource: str) -> list[FieldReq]:
    allowed = NODE_FIELDS if resource == "nodes" else POD_FIELDS
    reqs: list[FieldReq] = []
    if not text.strip():
        return reqs
    for raw in text.split(","):
        part = raw.strip()
        m = re.fullmatch(r"([^=!]+)(==|!=|=)(.*)", part)
        if not m:
            raise ApiError(bad_request(f"invalid selector: '{part}'; can't understand '{part}'"))
        path, op, value = m.group(1).strip(), m.group(2), m.group(3).strip()
        if path not in allowed:
            raise ApiError(bad_request(f"field label not supported: {path}"))
        reqs.append(FieldReq(path, op != "!=", value))
    return reqs


def _field_value(obj: Obj, path: str) -> str:
    cur: Any = obj
    for part in path.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    if cur is None:
        return "false" if path in ("spec.unschedulable", "spec.hostNetwork") else ""
    if isinstance(cur, bool):
        return "true" if cur else "false"
    return str(cur)


@dataclass(frozen=True)
class Selector:
    """What one list/watch request selects: namespace, label and field requirements."""

    namespace: str | None = None
    labels: tuple[LabelReq, ...] = ()
    fields: tuple[FieldReq, ...] = ()

    @property
    def filtered(self) -> bool:
        return bool(self.labels or self.fields)

    def matches(self, obj: Obj | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata") or {}
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        labels = meta.get("labels") or {}
        if not all(r.matches(labels) for r in self.labels):
            return False
        return all((_field_value(obj, f.path) == f.value) == f.equal for f in self.fields)
