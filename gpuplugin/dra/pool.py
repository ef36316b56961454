"""What one node's pool should hold now: the order for the current state, laid out stickily into slices. Pure.

`republish=False` keeps the order of the empty node forever (what a driver without republishing would publish;
bench/dra.py compares both).

`fallback` is the catalog to publish when the apiserver does not take the shared GPUs as multi-allocatable devices
(DRAConsumableCapacity off, or an API before it): the same node with every GPU whole. The publisher switches once
(`fall_back`), and only when `on_fallback` agrees: the driver refuses while a claim holds a shared device, because
that device would vanish under it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gpuplugin.dra.catalog import Catalog
from gpuplugin.dra.ordering import free_devices, publication_order
from gpuplugin.dra.slices import Layout, arrange, slice_contents


class PoolPlanner:
    def __init__(self, catalog: Catalog, *, taint_key: str, republish: bool = True, fallback: Catalog | None = None,
                 on_fallback: Callable[[Catalog], bool] = lambda catalog: True,
                 sick_devices: Callable[[], Iterable[str]] = lambda: ()) -> None:
        self.catalog = catalog
        self.sick_devices = sick_devices  # devices unhealthy by themselves (MIG instances), tainted
        self.taint_key = taint_key
        self.republish = republish
        self.fallback = fallback
        self.on_fallback = on_fallback
        self.layout: Layout | None = None
        self._static = publication_order(catalog)

    @property
    def shares_capacity(self) -> bool:
        """Whether the pool publishes multi-allocatable (consumable-capacity) devices."""
        return any(d.multi for d in self.catalog.devices.values())

    def fall_back(self) -> bool:
        """Publish the fallback catalog from now on; False when there is none or the driver refuses."""
        if self.fallback is None or not self.on_fallback(self.fallback):
            return False
        self.catalog, self.fallback = self.fallback, None
        self._static = publication_order(self.catalog)
        self.layout = None
        return True

    def order(self, used: Iterable[int] = (), unhealthy: Iterable[int] = ()) -> dict[str, list[str]]:
        return publication_order(self.catalog, used, unhealthy) if self.republish else self._static

    def wanted(self, used: Iterable[int] = (), unhealthy: Iterable[int] = ()) -> list[dict[str, Any]]:
        """Slice contents by index (0: the counters) for this state; remembers the layout for the next call."""
        used, unhealthy = set(used), set(unhealthy)
        order = self.order(used, unhealthy)
        free = free_devices(self.catalog, used, unhealthy) - set(self.sick_devices())
        self.layout = arrange(order, free, self.layout)
        return slice_contents(self.catalog, self.layout, unhealthy, taint_key=self.taint_key,
                              sick_devices=self.sick_devices())

    def adopt(self, contents: Sequence[Mapping[str, Any]]) -> None:
        """Start from the layout already on the server (contents by index), so a restarted driver can keep
        updating in place; `arrange` drops it if it no longer fits."""
        layout = []
        for content in contents[1:]:
            devices = content.get("devices")
            if devices is None:
                return
            layout.append(tuple(d.get("name", "") for d in devices))
        self.layout = tuple(layout) or None
