"""Shared fixtures of the DRA driver tests: topologies, catalogs and a slice store that plays the apiserver's part
for the pure publication tests."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from gpuplugin.dra.catalog import Catalog
from gpuplugin.dra.sync import Write, observed_from
from gputopo.core.topology import Topology
from gputopo.discovery.loader import load_topology_file
from tests.conftest import SHARED

DRIVER = "gpu-topology.io"
NODE = "gpu-node-1"
TAINT = f"{DRIVER}/unhealthy"
DGX1 = SHARED / "topologies" / "dgx1-v100-ucxpy.txt"
A6000 = SHARED / "topologies" / "pcie-8x-rtxa6000-nvlinkbridge-pairs-2socket-unige-baobab.txt"


@functools.cache
def topology(path: str) -> Topology:
    return load_topology_file(path)


@functools.cache
def catalog(path: str, max_devices: int = 512) -> Catalog:
    return Catalog.build(topology(path), max_devices=max_devices)


@pytest.fixture(scope="session")
def dgx1() -> Topology:
    return topology(str(DGX1))


class SliceStore:
    """Slices by name, written one write at a time, as the apiserver would store them."""

    def __init__(self) -> None:
        self.slices: dict[str, dict[str, Any]] = {}
        self._serial = 0

    def observed(self):
        return [observed_from(s) for s in self.slices.values()]

    def apply(self, write: Write) -> None:
        if write.op == "delete":
            del self.slices[write.name]
            return
        assert write.body is not None
        if write.op == "create":
            self._serial += 1
            name = f"{write.index:05x}-{DRIVER}-{NODE}-{self._serial:05d}"
        else:
            name = write.name
        self.slices[name] = dict(write.body, metadata={"name": name})

    def objects(self) -> list[Mapping[str, Any]]:
        return list(self.slices.values())


def device_counters(slices: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {d["name"]: d["consumesCounters"] for s in slices for d in s["spec"].get("devices") or ()}
