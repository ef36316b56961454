"""What one node's pool should hold now: the order for the current state, laid out stickily into slices. Pure.

`republish=False` keeps the order of the empty node forever (what a driver without republishing would publish;
bench/dra.py compares both).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from gpuplugin.dra.catalog import Catalog
from gpuplugin.dra.ordering import free_devices, publication_order
from gpuplugin.dra.slices import Layout, arrange, slice_contents


class PoolPlanner:
    def __init__(self, catalog: Catalog, *, taint_key: str, republish: bool = True) -> None:
        self.catalog = catalog
        self.taint_key = taint_key
        self.republish = republish
        self.layout: Layout | None = None
        self._static = publication_order(catalog)

    def order(self, used: Iterable[int] = (), unhealthy: Iterable[int] = ()) -> dict[str, list[str]]:
        return publication_order(self.catalog, used, unhealthy) if self.republish else self._static

    def wanted(self, used: Iterable[int] = (), unhealthy: Iterable[int] = ()) -> list[dict[str, Any]]:
        """Slice contents by index (0: the counters) for this state; remembers the layout for the next call."""
        used, unhealthy = set(used), set(unhealthy)
        order = self.order(used, unhealthy)
        self.layout = arrange(order, free_devices(self.catalog, used, unhealthy), self.layout)
        return slice_contents(self.catalog, self.layout, unhealthy, taint_key=self.taint_key)

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
