"""The order devices are published in, for the GPUs currently free: pure.

The scheduler's allocator takes the first free device in published order (and the first N free singles for a
request of N). So, per size, the free sets come first, best first for the free GPUs as they are now (the
allocator's score, including what each set leaves for later requests), then every other set in catalog order;
the singles come in an order whose first N form good rings (gputopo.core.ranking). Used and unhealthy GPUs are
never free. Only the order changes with the state: which devices exist never does (catalog.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from gpuplugin.dra.catalog import Catalog


def publication_order(
    catalog: Catalog, used: Iterable[int] = (), unhealthy: Iterable[int] = ()
) -> dict[int, list[str]]:
    """Device names per size (singles first), in the order to publish them for this state."""
    free = set(range(catalog.topology.size)) - set(used) - set(unhealthy)
    out: dict[int, list[str]] = {}
    for size, names in catalog.groups.items():
        devices = [catalog.devices[n] for n in names]
        if size == 1:
            first = [f"gpu-{g}" for g in catalog.ranker.single_order(free)]
        else:
            ranked = catalog.ranker.rank(free, [d.gpus for d in devices if free.issuperset(d.gpus)])
            first = [catalog.devices_by_gpus[m].name for m in ranked]
        taken = set(first)
        out[size] = first + [n for n in names if n not in taken]
    return out


def free_devices(catalog: Catalog, used: Iterable[int] = (), unhealthy: Iterable[int] = ()) -> set[str]:
    """Names of the devices whose GPUs are all free and healthy."""
    busy = set(used) | set(unhealthy)
    return {name for name, d in catalog.devices.items() if busy.isdisjoint(d.gpus)}
