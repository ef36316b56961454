"""The real kube-apiserver v1.36.2 admission recordings (fixtures/recordings/kube-apiserver-admission/)."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any

from tests.conftest import SHARED

ADMISSION = SHARED / "recordings" / "kube-apiserver-admission"
REQUEST_RAW = (ADMISSION / "admissionreview-request-pod-create-nvidia-gpu-2.raw.json").read_bytes()
RESPONSE = json.loads((ADMISSION / "admissionreview-response-jsonpatch-schedulername.json").read_text())
PATCH = json.loads((ADMISSION / "jsonpatch-decoded.json").read_text())
STORED = json.loads((ADMISSION / "pod-stored-after-patch.json").read_text())
SCHEDULER = "gpu-topology-scheduler"  # what the recording's webhook set


def request_headers() -> dict[str, str]:
    """The headers the API server sent with the review (Host and Content-Length are the client's to set)."""
    lines = (ADMISSION / "admissionreview-request-http-headers.txt").read_text().splitlines()[1:]
    pairs = (line.split(":", 1) for line in lines if ":" in line)
    return {k.strip(): v.strip() for k, v in pairs if k.strip() not in ("Host", "Content-Length")}


def request_path() -> str:
    """`/mutate?timeout=5s`: the API server appends its timeout to the configured path."""
    return (ADMISSION / "admissionreview-request-http-headers.txt").read_text().split()[1]


def review(mutate: Any = None) -> dict[str, Any]:
    """The recorded review as data, changed by `mutate(request)` when given."""
    data = json.loads(REQUEST_RAW)
    if mutate is not None:
        mutate(data["request"])
    return data


def pod_of(data: dict[str, Any]) -> dict[str, Any]:
    return data["request"]["object"]


def decoded_patch(answer: dict[str, Any]) -> list[dict[str, Any]]:
    return json.loads(base64.b64decode(answer["response"]["patch"]))


def apply_patch(document: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 `add` (the only operation the webhook sends), to object members and arrays (an index inserts, `-`
    appends): the API server's job, redone here to show what the stored pod becomes."""
    out = copy.deepcopy(document)
    for op in patch:
        assert op["op"] == "add", op
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        target: Any = out
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        value = copy.deepcopy(op["value"])
        if isinstance(target, list):
            assert last == "-" or 0 <= int(last) <= len(target), op
            target.insert(len(target) if last == "-" else int(last), value)
        else:
            target[last] = value
    return out
