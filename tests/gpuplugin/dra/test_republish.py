"""The trap of issue 15, proven over many republish sequences: no device a claim holds is ever missing or re-wired
in a pool state the allocator would use, and so no GPU is ever handed out twice, whatever the interleaving of
allocations (known to the driver or not yet), releases, health changes and the single writes of a republish.

The allocator is the documented one (sim/dra_allocator.py); the publisher's decisions are the pure ones it runs
(gpuplugin.dra.pool + gpuplugin.dra.sync); the apiserver is a store that applies one write at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuplugin.dra.catalog import ONE, Catalog
from gpuplugin.dra.pool import PoolPlanner
from gpuplugin.dra.sync import plan
from sim.dra_allocator import Alternative, DeviceRef, Request, allocate, pools
from sim.machines import pcie_bridge_server
from tests.gpuplugin.dra.conftest import (
    A6000,
    DGX1,
    DRIVER,
    NODE,
    TAINT,
    SliceStore,
    catalog,
    device_counters,
    selector,
)

TOPK = Catalog.build(pcie_bridge_server(10), max_devices=60)  # 10 GPUs, not every quad and 8-set fits


def _catalogs() -> dict[str, Catalog]:
    return {"dgx1": catalog(str(DGX1)), "a6000": catalog(str(A6000)), "topk-10": TOPK}


@dataclass
class World:
    catalog: Catalog
    planner: PoolPlanner
    store: SliceStore = field(default_factory=SliceStore)
    claims: dict[int, tuple[DeviceRef, ...]] = field(default_factory=dict)
    known: set[int] = field(default_factory=set)  # claims the driver has prepared
    unhealthy: set[int] = field(default_factory=set)
    serial: int = 0
    allocations: int = 0

    def held_gpus(self, claims) -> list[int]:
        return [g for c in claims for ref in self.claims[c] for g in self.catalog.devices[ref.device].gpus]

    def check(self) -> None:
        """The invariant, on the store as it is now (between any two writes)."""
        for pool in pools(self.store.objects()):
            if not pool.usable:
                continue
            published = {d["name"]: d for d in pool.devices}
            for refs in self.claims.values():
                for ref in refs:
                    assert ref.device in published, f"held device {ref.device} missing at generation {pool.generation}"
                    want = {f"gpu{g}" for g in self.catalog.devices[ref.device].gpus}
                    got = published[ref.device]["consumesCounters"]
                    assert [set(c["counters"]) for c in got] == [want], f"{ref.device} re-wired"
        gpus = self.held_gpus(self.claims)
        assert len(gpus) == len(set(gpus)), f"a GPU is held twice: {sorted(gpus)}"

    def try_allocate(self, kind: int | str, count: int) -> None:
        result = allocate(self.store.objects(), [r for refs in self.claims.values() for r in refs],
                          [Request("r", (Alternative(selector(kind), count),))])
        if result is not None:
            self.serial += 1
            self.claims[self.serial] = result.devices["r"]
            self.allocations += 1
        self.check()

    def republish(self, data: st.DataObject) -> None:
        used = self.held_gpus(self.known)
        writes = plan(self.store.observed(), self.planner.wanted(used, self.unhealthy), driver=DRIVER, node=NODE)
        for write in writes:
            self.store.apply(write)
            self.check()
            if data.draw(st.integers(0, 3)) == 0:  # the scheduler allocates between two writes
                self.try_allocate(*data.draw(REQUESTS))


REQUESTS = st.sampled_from([(1, 1), (1, 2), (1, 3), (ONE, 1), (ONE, 2), (2, 1), (4, 1), (8, 1), (2, 2)])


def run(world: World, data: st.DataObject, steps: int) -> None:
    world.republish(data)
    for _ in range(steps):
        op = data.draw(st.sampled_from(["allocate", "prepare", "release", "health", "kubelet-deletes"]))
        if op == "allocate":
            world.try_allocate(*data.draw(REQUESTS))
        elif op == "prepare":
            unknown = sorted(set(world.claims) - world.known)
            if unknown:
                world.known.add(data.draw(st.sampled_from(unknown)))
                world.republish(data)
        elif op == "release" and world.claims:
            claim = data.draw(st.sampled_from(sorted(world.claims)))
            del world.claims[claim]
            world.known.discard(claim)
            world.republish(data)
        elif op == "health":
            gpu = data.draw(st.integers(0, world.catalog.topology.size - 1))
            world.unhealthy ^= {gpu}
            world.republish(data)
        elif op == "kubelet-deletes":
            victims = data.draw(st.lists(st.sampled_from(sorted(world.store.slices) or ["-"]), unique=True))
            for name in victims:
                world.store.slices.pop(name, None)
                world.check()
            world.republish(data)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
@pytest.mark.parametrize("name", sorted(_catalogs()))
def test_no_held_device_is_ever_missing_or_rewired(name: str, data: st.DataObject) -> None:
    cat = _catalogs()[name]
    world = World(cat, PoolPlanner(cat, taint_key=TAINT))
    run(world, data, data.draw(st.integers(4, 16)))


def test_sequences_do_allocate_and_republish_in_place_and_by_generation() -> None:
    """The property above is not vacuous: a fixed churn allocates, reorders in place (sticky layout), and a
    deleted slice makes the pool rewrite at the next generation."""
    cat = catalog(str(DGX1))
    world = World(cat, PoolPlanner(cat, taint_key=TAINT))

    class Fixed:
        def draw(self, strategy: Any) -> Any:
            return 1 if strategy is not REQUESTS else (4, 1)

    world.republish(Fixed())
    generations = set()
    in_place = 0
    for kind, count in [(4, 1), (2, 1), (1, 1), (ONE, 1)]:
        world.try_allocate(kind, count)
        world.known = set(world.claims)
        before = {s["spec"]["pool"]["generation"] for s in world.store.objects()}
        writes = plan(world.store.observed(), world.planner.wanted(world.held_gpus(world.known)),
                      driver=DRIVER, node=NODE)
        for w in writes:
            world.store.apply(w)
            world.check()
        after = {s["spec"]["pool"]["generation"] for s in world.store.objects()}
        generations |= after
        in_place += before == after and bool(writes)
    assert world.allocations == 4 and in_place == 4 and generations == {1}
    assert [r.device.split("-")[0] for refs in world.claims.values() for r in refs][2:] == ["gpu", "one"]
    world.store.slices.pop(sorted(world.store.slices)[2])  # the kubelet deletes a slice: rewrite at generation 2
    world.republish(Fixed())
    assert {s["spec"]["pool"]["generation"] for s in world.store.objects()} == {2}
    assert len(world.store.slices) == 4


def test_the_check_catches_a_publisher_that_drops_held_devices() -> None:
    """Negative control: publishing only free devices (a naive top-K per state) re-wires the pool under a held
    quad, and the documented allocator then hands its GPUs out again."""
    cat = catalog(str(DGX1))
    world = World(cat, PoolPlanner(cat, taint_key=TAINT))
    world.republish(_Never())
    world.try_allocate(4, 1)
    held = world.claims[1][0].device
    naive = [dict(c) for c in world.planner.wanted()]
    naive[1:] = [{"devices": [d for d in c["devices"] if d["name"] != held]} for c in naive[1:]]
    for write in plan(world.store.observed(), naive, driver=DRIVER, node=NODE):
        world.store.apply(write)
    assert held not in device_counters(world.store.objects())
    with pytest.raises(AssertionError, match=r"missing|twice"):
        world.try_allocate(8, 1)


class _Never:
    def draw(self, strategy: Any) -> Any:
        return 1
