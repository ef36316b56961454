"""The JSON objects the fake stores and serves, and the small helpers every part of it shares."""

from __future__ import annotations

import time
from typing import Any

import orjson

Obj = dict[str, Any]


def clone(obj: Any) -> Any:
    return orjson.loads(orjson.dumps(obj))


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def with_rv(obj: Obj, rv: int) -> Obj:
    new = dict(obj)
    new["metadata"] = dict(obj["metadata"], resourceVersion=str(rv))
    return new
