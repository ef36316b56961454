"""Shared fixtures of the DRA driver tests: topologies, catalogs and a slice store that plays the apiserver's part
for the pure publication tests."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass as _dataclass
from pathlib import Path
from typing import Any

import pytest

from gpuplugin.dra.catalog import ONE, Catalog
from gpuplugin.dra.cdi import CdiWriter
from gpuplugin.dra.driver import Driver
from gpuplugin.dra.pool import PoolPlanner
from gpuplugin.dra.publisher import SlicePublisher
from gpuplugin.dra.server import DraServer
from gpuplugin.dra.state import StateFile
from gpuplugin.dra.sync import Write, observed_from
from gputopo.core.topology import Topology
from gputopo.discovery.loader import load_topology_file
from gputopo.kube import make_api_client
from gputopo.kube.dra import get_claim
from sim.dra_allocator import Alternative, DeviceRef, Request, Selector, allocate, by_size, one_gpu
from sim.dra_kubelet import DraKubeletSim
from tests.fakes.kubeapi import FakeDraKubeApi
from tests.helpers.paths import SHARED, short_dir
from tests.helpers.polling import eventually

DRIVER = "gpu-topology.io"
NODE = "gpu-node-1"
TAINT = f"{DRIVER}/unhealthy"
DGX1 = SHARED / "topologies" / "dgx1-v100-ucxpy.txt"
A6000 = SHARED / "topologies" / "pcie-8x-rtxa6000-nvlinkbridge-pairs-2socket-unige-baobab.txt"


def selector(kind: int | str) -> Selector:
    """A class of ours: GPU sets or ring-ordered singles (gpu.<driver>) by size, or ONE: the singles of the
    one-gpu class (the same GPUs and counters as the ring-ordered ones, in another order)."""
    return one_gpu(DRIVER) if kind == ONE else by_size(DRIVER, int(kind))


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


# ---- a whole node: fake apiserver, the driver in-process on real sockets, the kubelet stand-in ----



RECORDED_CLAIM = SHARED / "recordings" / "kube-apiserver-dra" / "resourceclaim-before-allocation.json"


@_dataclass
class DraNode:
    fake: FakeDraKubeApi
    api: Any
    root: Path
    driver: Driver
    publisher: SlicePublisher
    server: DraServer
    kubelet: DraKubeletSim

    def claim(self, name: str, size: int | str = 4, count: int = 1, config: list | None = None,
              device: str | None = None) -> tuple[str, str, str]:
        """A claim as a user creates it for `count` devices of class `size` (see `selector`), allocated as the
        scheduler's allocator would on the published slices (or to `device`), with the recorded shapes. Returns
        (namespace, uid, name)."""
        body = json.loads(RECORDED_CLAIM.read_text())
        body["metadata"] = {"name": name, "namespace": "default"}
        created = self.fake.add_claim(body)
        if device is None:
            held = [r for c in self.driver.prepared().values() for r in c.devices]
            refs = [DeviceRef(DRIVER, NODE, d.device) for d in held]
            result = allocate(self.fake.slices(NODE), refs, [Request("gpus", (Alternative(selector(size), count),))])
            assert result is not None, "the allocator found nothing"
            results = [{"request": "gpus", "driver": DRIVER, "pool": r.pool, "device": r.device}
                       for r in result.devices["gpus"]]
        else:
            results = [{"request": "gpus", "driver": DRIVER, "pool": NODE, "device": device}]
        self.fake.allocate_claim("default", name, NODE, results, config)
        return ("default", created["metadata"]["uid"], name)

    def slices(self) -> list[dict]:
        return self.fake.slices(NODE)

    def settled(self, timeout: float = 15.0) -> bool:
        """True once the pool on the server is complete at one generation and a sync found nothing to write."""
        def ok() -> bool:
            s = self.slices()
            gens = {x["spec"]["pool"]["generation"] for x in s}
            return bool(s) and len(gens) == 1 and len(s) == s[0]["spec"]["pool"]["resourceSliceCount"]
        return eventually(lambda: ok() and not self.publisher.sync(), timeout)


def make_driver(api: Any, root: Path, **kwargs: Any) -> tuple[Driver, SlicePublisher]:
    cat = catalog(str(DGX1))
    publisher_box: list[SlicePublisher] = []
    driver = Driver(cat, driver_name=DRIVER, pool=NODE, state=StateFile(root / "plugin" / "state.json"),
                    cdi=CdiWriter(root / "cdi", DRIVER), get_claim=lambda ns, n: get_claim(api, ns, n),
                    on_change=lambda: publisher_box[0].request() if publisher_box else None, **kwargs)
    publisher = SlicePublisher(api, PoolPlanner(cat, taint_key=TAINT),
                               lambda: (driver.used_gpus(), driver.unhealthy_gpus()), driver=DRIVER, node=NODE,
                               min_interval_s=0.0)
    publisher_box.append(publisher)
    return driver, publisher


@pytest.fixture
def dra_node() -> Iterator[DraNode]:
    with short_dir("dra-") as root, FakeDraKubeApi() as fake:
        fake.add_node({"metadata": {"name": NODE}})
        api = make_api_client(host=fake.url, timeout_s=5.0)
        driver, publisher = make_driver(api, root)
        publisher.start()
        server = DraServer(driver, root / "registry", root / "plugin", poll_interval_s=0.1).start()
        kubelet = DraKubeletSim(root / "registry", NODE, api, slice_grace_s=0.5).start()
        try:
            kubelet.wait_registered(DRIVER)
            yield DraNode(fake, api, root, driver, publisher, server, kubelet)
        finally:
            kubelet.stop()
            server.stop()
            publisher.stop()
            api.close()
