"""ResourceSlice contents for one node's pool: which device goes into which slice, and the slice objects. Pure.

One pool per node, named after the node (counter-set slices are seen by every node's allocator, so pool names
must not collide). Slice 0 holds only the shared counter set (one counter per GPU); slices 1.. hold devices, at
most 64 each (the apiserver's limit for counter-consuming devices), in catalog group order (the two single-GPU
groups, then each set size); a group that does not fit in the current slice starts a new one.

Layouts are sticky: when the new order can be published by reordering devices inside the slices they are
already in (the free devices of every group still appear in the new order when read slice by slice), the old
membership is kept. The publisher then updates slices in place at the same pool generation, and no device is ever
absent or listed twice in between; otherwise it bumps the generation and rewrites the pool (sync.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gpuplugin.dra.catalog import COUNTER_SET, Catalog, counter_name

MAX_DEVICES_PER_SLICE = 64
MAX_NAME = 253  # metadata.name of a ResourceSlice: a DNS subdomain
GENERATED_BASE_MAX = 58  # what the apiserver keeps of a generateName (63 minus its 5 random characters)
API_VERSION = "resource.k8s.io/v1"
Layout = tuple[tuple[str, ...], ...]


def pack(order: Mapping[str, Sequence[str]], limit: int = MAX_DEVICES_PER_SLICE) -> Layout:
    """A fresh layout: groups in `order`'s order, a group that does not fit in the current slice starts a new one
    (groups over `limit` fill whole slices and their tail may share with the next group)."""
    slices: list[list[str]] = [[]]
    for names in order.values():
        group = list(names)
        if len(group) <= limit - len(slices[-1]):
            slices[-1].extend(group)
            continue
        if slices[-1]:
            slices.append([])
        for i in range(0, len(group), limit):
            chunk = group[i : i + limit]
            if len(slices[-1]) + len(chunk) > limit:
                slices.append([])
            slices[-1].extend(chunk)
    return tuple(tuple(s) for s in slices if s)


def arrange(
    order: Mapping[str, Sequence[str]],
    free: Iterable[str],
    previous: Layout | None = None,
    limit: int = MAX_DEVICES_PER_SLICE,
) -> Layout:
    """The layout for `order`: `previous` with each slice reordered when that keeps every group's free devices
    in the new order, else a fresh `pack`."""
    if previous is not None:
        position = {name: i for k, names in enumerate(order.values()) for i, name in enumerate(names, start=k << 20)}
        kept = tuple(tuple(sorted(s, key=lambda n: position.get(n, -1))) for s in previous)
        if _keeps_order(kept, order, set(free), position, limit):
            return kept
    return pack(order, limit)


def _keeps_order(
    layout: Layout, order: Mapping[str, Sequence[str]], free: set[str], position: Mapping[str, int], limit: int
) -> bool:
    flat = [n for s in layout for n in s]
    if len(flat) != len(position) or set(flat) != set(position) or any(len(s) > limit for s in layout):
        return False
    for group in order.values():
        members = set(group)
        wanted = [n for n in group if n in free]
        if [n for n in flat if n in members and n in free] != wanted:
            return False
    return True


def counter_slice_spec(catalog: Catalog) -> dict[str, Any]:
    counters = {counter_name(g): {"value": "1"} for g in range(catalog.topology.size)}
    return {"sharedCounters": [{"name": COUNTER_SET, "counters": counters}]}


def device_spec(catalog: Catalog, name: str, unhealthy: Iterable[int], taint_key: str,
                sick: Iterable[str] = ()) -> dict[str, Any]:
    """One device as the slice lists it. Whole GPUs and sets consume their GPUs' counters; a shared GPU carries
    `allowMultipleAllocations` and its capacity (with request policies, which the apiserver accepts only together
    with allowMultipleAllocations); a MIG instance its capacity alone."""
    device = catalog.devices[name]
    out: dict[str, Any] = {"name": name, "attributes": dict(device.attributes)}
    if device.kind == "gpus":
        out["consumesCounters"] = [
            {"counterSet": COUNTER_SET, "counters": {counter_name(g): {"value": "1"} for g in device.gpus}}
        ]
    if device.capacity:
        out["capacity"] = {k: dict(v) for k, v in device.capacity.items()}
    if device.multi:
        out["allowMultipleAllocations"] = True
    if not set(unhealthy).isdisjoint(device.gpus) or name in set(sick):
        out["taints"] = [{"key": taint_key, "effect": "NoSchedule"}]
    return out


def slice_contents(
    catalog: Catalog, layout: Layout, unhealthy: Iterable[int] = (), *, taint_key: str,
    sick_devices: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """The `spec` parts that differ per slice (sharedCounters or devices), index 0 first. Devices on `unhealthy`
    GPUs and those named in `sick_devices` (MIG instances with their own Xids) are tainted."""
    sick = set(unhealthy)
    names_sick = set(sick_devices)
    out = [counter_slice_spec(catalog)]
    out += [{"devices": [device_spec(catalog, n, sick, taint_key, names_sick) for n in names]} for names in layout]
    return out


def slice_object(
    content: Mapping[str, Any], *, driver: str, node: str, generation: int, count: int
) -> dict[str, Any]:
    """A whole ResourceSlice body (no metadata) for one slice's content."""
    spec: dict[str, Any] = {
        "driver": driver,
        "pool": {"name": node, "generation": generation, "resourceSliceCount": count},
        "nodeName": node,
    }
    spec.update(content)
    return {"apiVersion": API_VERSION, "kind": "ResourceSlice", "spec": spec}


def slice_name_prefix(index: int, driver: str, node: str) -> str:
    """generateName of slice `index`, as the Go helper forms it: names sort in index order."""
    return f"{index:05x}-{driver}-{node}-"


def slice_name(index: int, driver: str, node: str) -> str:
    """A fixed metadata.name for slice `index` (what `gpuplugin slices` prints, so `kubectl apply` takes it):
    `<node>-<driver>-<index, 5 hex digits>`, the form of the recorded slices' names, sorting in index order within
    the pool. It never parses as one the driver generated (those start with the index), so a driver started on the
    node replaces such slices with its own. Driver and node are DNS subdomains, so the name is one; past 253
    characters the `<node>-<driver>` part is cut and ends in a hash of the whole."""
    base = f"{node}-{driver}"
    if len(base) + 6 > MAX_NAME:
        digest = hashlib.sha256(base.encode()).hexdigest()[:8]
        base = base[: MAX_NAME - 6 - len(digest) - 1].rstrip("-.") + "-" + digest
    return f"{base}-{index:05x}"


def parse_slice_index(name: str, driver: str, node: str) -> int | None:
    """The index of a slice this driver created for `node`, from the name the apiserver completed its generateName
    into, else None. The apiserver cuts a generateName to 58 characters before adding its 5 random ones
    (k8s.io/apiserver/pkg/storage/names), which node names of 36 characters and more reach (EKS names nodes like
    ip-10-0-12-34.us-west-2.compute.internal): the cut prefix must still count as ours."""
    head, sep, _ = name.partition("-")
    if not sep or len(head) < 5:
        return None
    try:
        index = int(head, 16)
    except ValueError:
        return None
    base = slice_name_prefix(index, driver, node)[:GENERATED_BASE_MAX]
    return index if name.startswith(base) and len(name) > len(base) else None
