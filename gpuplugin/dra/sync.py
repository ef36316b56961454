"""From the slices on the server to the wanted ones: the list of writes, in the order that keeps the pool safe. Pure.

The allocator uses only the highest generation of a pool, and skips the pool while that generation is incomplete
(fewer slices than resourceSliceCount). So:
1. Obsolete slices (not ours by name, an index past the end, a second slice for one index) are deleted first.
2. If every index has its one slice at the current generation with the wanted count and the same device names,
   the slices whose content changed are updated in place at that generation: each device stays in its slice, so
   at no moment is a device missing or listed twice, and the pool stays usable throughout.
3. Otherwise the generation goes up by one and every slice is rewritten (updated, or created when missing): until
   the last write the new generation is incomplete, so the allocator offers nothing from the pool instead of a
   half-written one.
Neither path can make a device that a claim holds disappear or change its counters at a usable generation,
because every wanted content holds every device of the catalog with its fixed counters (catalog.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gpuplugin.dra.slices import parse_slice_index, slice_object


@dataclass(frozen=True)
class Observed:
    """One of our node's slices as the server has it."""

    name: str
    generation: int
    count: int
    content: Mapping[str, Any]  # sharedCounters or devices
    resource_version: str = ""


@dataclass(frozen=True)
class Write:
    op: Literal["create", "update", "delete"]
    index: int | None
    name: str | None  # the slice updated or deleted; None for a create
    body: dict[str, Any] | None  # the whole object (no metadata) for create and update
    resource_version: str = ""


def observed_from(obj: Mapping[str, Any]) -> Observed:
    """An Observed from a ResourceSlice dict as the apiserver returns it."""
    spec = obj.get("spec") or {}
    pool = spec.get("pool") or {}
    content = {k: spec[k] for k in ("sharedCounters", "devices") if k in spec}
    meta = obj.get("metadata") or {}
    return Observed(
        name=str(meta.get("name", "")),
        generation=int(pool.get("generation") or 0),
        count=int(pool.get("resourceSliceCount") or 0),
        content=content,
        resource_version=str(meta.get("resourceVersion") or ""),
    )


def _names(content: Mapping[str, Any]) -> tuple[str, ...] | None:
    devices = content.get("devices")
    return None if devices is None else tuple(sorted(d.get("name", "") for d in devices))


def plan(observed: Sequence[Observed], wanted: Sequence[Mapping[str, Any]], *, driver: str, node: str) -> list[Write]:
    """The writes that take the server from `observed` to `wanted` (contents by index), safely (module docstring)."""
    by_index: dict[int, Observed] = {}
    writes: list[Write] = []
    for o in sorted(observed, key=lambda o: (-o.generation, o.name)):
        index = parse_slice_index(o.name, driver, node)
        if index is None or index >= len(wanted) or index in by_index:
            writes.append(Write("delete", index, o.name, None, o.resource_version))
        else:
            by_index[index] = o
    generation = max((o.generation for o in observed), default=0)
    count = len(wanted)
    in_place = len(by_index) == count and all(
        o.generation == generation and o.count == count and _names(o.content) == _names(wanted[i])
        for i, o in by_index.items()
    )
    if in_place:
        for i in range(count):
            o = by_index[i]
            if dict(o.content) != dict(wanted[i]):
                body = slice_object(wanted[i], driver=driver, node=node, generation=generation, count=count)
                writes.append(Write("update", i, o.name, body, o.resource_version))
        return writes
    generation += 1
    for i in range(count):
        body = slice_object(wanted[i], driver=driver, node=node, generation=generation, count=count)
        o = by_index.get(i)
        if o is None:
            writes.append(Write("create", i, None, body))
        else:
            writes.append(Write("update", i, o.name, body, o.resource_version))
    return writes
