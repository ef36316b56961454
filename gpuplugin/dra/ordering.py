"""The order devices are published in, for the GPUs currently free: pure.

The scheduler's allocator takes the first free device in published order (and the first N free singles for a
request of N). So, per group, the free devices come first, then every other device of the group in catalog order:
- sets of each size: best first for the free GPUs as they are now (the allocator's score, including what each set
  leaves for later requests);
- singles `gpu-<i>` (requests of N singles, `nvidia.com/gpu: N`): an order whose first N form good rings;
- singles `one-<i>` (1-GPU claims): the order successive 1-GPU allocations should take them, so that a lone GPU is
  taken where it breaks no block (gputopo.core.ranking says why one order cannot serve both).
Used and unhealthy GPUs are never free, nor are shared ones for the whole-GPU groups. Shared GPUs and MIG instances
keep their catalog order (one device per GPU or instance: there is nothing to choose between for the allocator's
first fit that the class's selectors do not already decide). Only the order changes with the state: which devices
exist never does (catalog.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuplugin.dra.catalog import ONE, RINGS, STATIC_GROUPS, Catalog, device_name


def publication_order(
    catalog: Catalog, used: Iterable[int] = (), unhealthy: Iterable[int] = ()
) -> dict[str, list[str]]:
    """Device names per group (catalog.groups' keys and order), in the order to publish them for this state."""
    free = set(catalog.whole) - set(used) - set(unhealthy)
    out: dict[str, list[str]] = {}
    for group, names in catalog.groups.items():
        if group in STATIC_GROUPS:
            out[group] = list(names)
            continue
        if group == RINGS:
            first = [device_name((g,), RINGS) for g in catalog.ranker.single_order(free)]
        elif group == ONE:
            first = [device_name((g,), ONE) for g in catalog.ranker.one_at_a_time_order(free)]
        else:
            devices = [catalog.devices[n] for n in names]
            ranked = catalog.ranker.rank(free, [d.gpus for d in devices if free.issuperset(d.gpus)])
            first = [device_name(m) for m in ranked]
        taken = set(first)
        out[group] = first + [n for n in names if n not in taken]
    return out


def free_devices(catalog: Catalog, used: Iterable[int] = (), unhealthy: Iterable[int] = ()) -> set[str]:
    """Names of the devices whose GPUs are all free and healthy."""
    busy = set(used) | set(unhealthy)
    return {name for name, d in catalog.devices.items() if busy.isdisjoint(d.gpus)}
