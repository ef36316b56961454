"""The kube-scheduler's DRA allocator as documented for 1.36 (docs/reference/dra-api.md, section 6), over
ResourceSlice dicts: what the tests and bench/dra.py put the published slices through.

- Per pool (driver, pool name) only the highest generation counts; a pool whose slices at that generation number
  differs from resourceSliceCount is skipped, so is an invalid one (a device or counter set named twice, a device
  consuming a counter that does not exist).
- Order: pools by (driver, pool name), slices by metadata.name, devices in list order; first complete solution of
  a depth-first search with backtracking wins (combinations, not permutations); firstAvailable alternatives in
  their listed order. No scoring.
- Counters: a device fits when, for each counter it consumes, total - used - picked so far >= its value. The used
  counters of allocated devices are read from the devices as currently published: a held device that disappeared
  or was re-wired no longer uses its counters (the trap of issue 15, reproduced here on purpose).
- Devices already allocated are never picked again; NoSchedule/NoExecute taints exclude a device unless tolerated.

Class selectors are CEL in a real cluster; here a request names a Python predicate over (driver, device dict).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Selector = Callable[[str, Mapping[str, Any]], bool]
MAX_STEPS = 200_000  # the real allocator has a 10 s Filter timeout; this bounds the search instead


@dataclass(frozen=True, order=True)
class DeviceRef:
    driver: str
    pool: str
    device: str


@dataclass(frozen=True)
class Alternative:
    """One way to satisfy a request: `count` devices (ExactCount) that `selector` accepts."""

    selector: Selector
    count: int = 1
    tolerate_taints: bool = False


@dataclass(frozen=True)
class Request:
    name: str
    alternatives: tuple[Alternative, ...]  # `exactly` is a single alternative; firstAvailable lists up to 8


@dataclass
class Pool:
    driver: str
    name: str
    generation: int
    devices: list[dict[str, Any]] = field(default_factory=list)
    counters: dict[tuple[str, str], int] = field(default_factory=dict)
    usable: bool = True
    why: str = ""


@dataclass(frozen=True)
class Allocation:
    devices: dict[str, tuple[DeviceRef, ...]]  # request name -> devices
    chosen: dict[str, int]  # request name -> index of the firstAvailable alternative used

    @property
    def score(self) -> int:
        """The DRA Score plugin's contribution: 8 - index of the alternative chosen, summed over requests."""
        return sum(8 - i for i in self.chosen.values())


def _value(q: Any) -> int:
    return int(str(q.get("value", "0")) if isinstance(q, Mapping) else str(q))


def pools(slices: Iterable[Mapping[str, Any]]) -> list[Pool]:
    """Every pool in allocator order, with its usable state (highest generation, complete, valid)."""
    by_pool: dict[tuple[str, str], list[Mapping[str, Any]]] = defaultdict(list)
    for s in slices:
        spec = s["spec"]
        by_pool[(spec["driver"], spec["pool"]["name"])].append(s)
    out = []
    for (driver, name), group in sorted(by_pool.items()):
        generation = max(int(s["spec"]["pool"].get("generation", 0)) for s in group)
        current = sorted((s for s in group if int(s["spec"]["pool"].get("generation", 0)) == generation),
                         key=lambda s: s["metadata"]["name"])
        pool = Pool(driver, name, generation)
        wanted = {int(s["spec"]["pool"]["resourceSliceCount"]) for s in current}
        if wanted != {len(current)}:
            pool.usable, pool.why = False, f"incomplete: {len(current)} slices at generation {generation}"
            out.append(pool)
            continue
        names: set[str] = set()
        for s in current:
            for cs in s["spec"].get("sharedCounters") or ():
                for counter, q in cs["counters"].items():
                    if (cs["name"], counter) in pool.counters:
                        pool.usable, pool.why = False, f"counter {cs['name']}/{counter} twice"
                    pool.counters[(cs["name"], counter)] = _value(q)
            for d in s["spec"].get("devices") or ():
                if d["name"] in names:
                    pool.usable, pool.why = False, f"device {d['name']} twice"
                names.add(d["name"])
                pool.devices.append(d)
        for d in pool.devices:
            for c in d.get("consumesCounters") or ():
                if any((c["counterSet"], k) not in pool.counters for k in c["counters"]):
                    pool.usable, pool.why = False, f"device {d['name']} consumes a counter that does not exist"
        out.append(pool)
    return out


def _consumption(device: Mapping[str, Any]) -> dict[tuple[str, str], int]:
    out: dict[tuple[str, str], int] = defaultdict(int)
    for c in device.get("consumesCounters") or ():
        for k, q in c["counters"].items():
            out[(c["counterSet"], k)] += _value(q)
    return out


def used_counters(view: Sequence[Pool], allocated: Iterable[DeviceRef]) -> dict[tuple[str, str, str, str], int]:
    """Counters in use, read from the devices as published now (see the module docstring)."""
    index = {(p.driver, p.name, d["name"]): d for p in view if p.usable for d in p.devices}
    used: dict[tuple[str, str, str, str], int] = defaultdict(int)
    for ref in allocated:
        device = index.get((ref.driver, ref.pool, ref.device))
        if device is None:
            continue
        for (cs, k), v in _consumption(device).items():
            used[(ref.driver, ref.pool, cs, k)] += v
    return used


def allocate(
    slices: Iterable[Mapping[str, Any]], allocated: Iterable[DeviceRef], requests: Sequence[Request]
) -> Allocation | None:
    """The allocator's answer for one claim on one node's slices, or None when it cannot be satisfied."""
    view = pools(slices)
    taken = set(allocated)
    used = used_counters(view, taken)
    candidates = [(p, d) for p in view if p.usable for d in p.devices]
    steps = 0

    def fits(pool: Pool, device: Mapping[str, Any], extra: Mapping[tuple[str, str, str, str], int]) -> bool:
        for (cs, k), v in _consumption(device).items():
            key = (pool.driver, pool.name, cs, k)
            if pool.counters.get((cs, k), 0) - used[key] - extra.get(key, 0) < v:
                return False
        return True

    def search(i: int, picked: list[DeviceRef], extra: dict, result: dict, chosen: dict) -> bool:
        nonlocal steps
        if i == len(requests):
            return True
        req = requests[i]
        for alt_index, alt in enumerate(req.alternatives):
            pool_devices = [(p, d) for p, d in candidates if alt.selector(p.driver, d)
                            and (alt.tolerate_taints or not any(t.get("effect") in ("NoSchedule", "NoExecute")
                                                                 for t in d.get("taints") or ()))]

            def choose(start: int, got: list[DeviceRef], alt_index: int = alt_index, alt: Alternative = alt,
                       pool_devices: list = pool_devices) -> bool:
                nonlocal steps
                if len(got) == alt.count:
                    result[req.name] = tuple(got)
                    chosen[req.name] = alt_index
                    return search(i + 1, picked + got, extra, result, chosen)
                for j in range(start, len(pool_devices)):
                    steps += 1
                    if steps > MAX_STEPS:
                        return False
                    p, d = pool_devices[j]
                    ref = DeviceRef(p.driver, p.name, d["name"])
                    if ref in taken or ref in picked or ref in got or not fits(p, d, extra):
                        continue
                    added = {(p.driver, p.name, cs, k): v for (cs, k), v in _consumption(d).items()}
                    for key, v in added.items():
                        extra[key] = extra.get(key, 0) + v
                    if choose(j + 1, [*got, ref]):
                        return True
                    for key, v in added.items():
                        extra[key] -= v
                return False

            if choose(0, []):
                return True
        return False

    result: dict[str, tuple[DeviceRef, ...]] = {}
    chosen: dict[str, int] = {}
    if not search(0, [], {}, result, chosen):
        return None
    return Allocation(result, chosen)


def attribute(device: Mapping[str, Any], driver: str, name: str) -> Any:
    """An attribute's value as CEL sees `device.attributes[driver].name` (None when absent)."""
    attrs = device.get("attributes") or {}
    value = attrs.get(name, attrs.get(f"{driver}/{name}"))
    if value is None:
        return None
    return next(iter(value.values()))


def by_size(driver: str, size: int, min_gbps: int = 0) -> Selector:
    """The selector of this project's classes for `size` GPUs (and at least `min_gbps`): gpu-set-<size>.<driver>
    for sets; for size 1, gpu.<driver>, the singles in ring order (what `nvidia.com/gpu: N` and the `any-N` tiers
    get), not the one-<i> singles of the one-gpu class."""
    def select(d_driver: str, device: Mapping[str, Any]) -> bool:
        return (d_driver == driver and attribute(device, driver, "size") == size
                and (size != 1 or attribute(device, driver, "order") == "rings")
                and (attribute(device, driver, "allreduceGBps") or 0) >= min_gbps)
    return select


def one_gpu(driver: str) -> Selector:
    """The selector of the class one-gpu.<driver>: the singles ordered for 1-GPU claims (the one-gpu template)."""
    def select(d_driver: str, device: Mapping[str, Any]) -> bool:
        return (d_driver == driver and attribute(device, driver, "size") == 1
                and attribute(device, driver, "order") == "one")
    return select
