"""The published order follows claims the scheduler has allocated but the kubelet has not yet prepared (issue 20,
item 6): pods asking `nvidia.com/gpu: 2` that come one after another, before any of them starts, each get the best
pair left, not the next pair of an order one step stale.

The scheduler's part is the documented allocator (sim/dra_allocator.py) over the slices on the in-process
apiserver, writing each allocation in the recorded shape; the driver's publisher runs as in `gpuplugin dra`, with
its watches, over real HTTP. Nothing is prepared: the pods have not started.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuplugin.dra.catalog import Catalog
from gpuplugin.dra.publisher import SlicePublisher
from gputopo.kube import make_api_client
from sim.dra_allocator import Alternative, DeviceRef, Request, allocate, by_size, pools
from tests.fakes.kubeapi import FakeDraKubeApi
from tests.gpuplugin.dra.conftest import DRIVER, NODE, RECORDED_CLAIM, make_driver
from tests.helpers.paths import short_dir
from tests.helpers.polling import eventually


class Cluster:
    """The apiserver with the driver's publisher running, and the scheduler's side: claims allocated in turn."""

    def __init__(self, fake: FakeDraKubeApi, publisher: SlicePublisher) -> None:
        self.fake = fake
        self.publisher = publisher
        self.catalog: Catalog = publisher.planner.catalog
        self.allocated: list[DeviceRef] = []
        self._serial = itertools.count()

    def ring_order(self) -> list[int]:
        """GPUs of the ring-ordered singles (what `nvidia.com/gpu: N` gets) in published order; empty while the
        pool is not usable (a generation being written)."""
        (pool,) = pools(self.fake.slices(NODE)) or [None]
        if pool is None or not pool.usable:
            return []
        return [self.catalog.devices[d["name"]].gpus[0] for d in pool.devices
                if d["attributes"].get("order") == {"string": "rings"}]

    def order_follows_allocations(self) -> bool:
        held = self.catalog.gpus_of(r.device for r in self.allocated)
        order = self.ring_order()
        return bool(order) and set(order[len(order) - len(held):]) == held

    def claim(self, name: str, count: int, pool: str = NODE, driver: str = DRIVER) -> tuple[int, ...]:
        """A pod's claim for `count` ring-ordered singles, allocated as the scheduler would, once the driver had
        the time to republish what it could see (a second at most)."""
        eventually(self.order_follows_allocations, timeout=1.0, interval=0.02)
        assert self.ring_order(), "the pool is not usable"
        result = allocate(self.fake.slices(NODE), self.allocated,
                          [Request("gpus", (Alternative(by_size(DRIVER, 1), count),))])
        assert result is not None, "the allocator found nothing"
        refs = result.devices["gpus"]
        self.allocated += refs
        self.write_allocation(name, [{"request": "gpus", "driver": driver, "pool": pool, "device": r.device}
                                     for r in refs])
        return tuple(sorted(g for r in refs for g in self.catalog.devices[r.device].gpus))

    def write_allocation(self, name: str, results: list[dict[str, Any]]) -> None:
        body = json.loads(RECORDED_CLAIM.read_text())
        body["metadata"] = {"name": name, "namespace": "default"}
        self.fake.add_claim(body)
        self.fake.allocate_claim("default", name, NODE, results)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    with short_dir("dra-") as root, FakeDraKubeApi() as fake:
        fake.add_node({"metadata": {"name": NODE}})
        api = make_api_client(host=fake.url, timeout_s=5.0)
        _, publisher = make_driver(api, Path(root))
        publisher.start()
        try:
            cluster = Cluster(fake, publisher)
            assert eventually(lambda: cluster.ring_order() != [], timeout=10), "the pool was never published"
            yield cluster
        finally:
            publisher.stop()
            api.close()


def test_a_burst_of_two_gpu_pods_gets_the_best_pairs_before_any_is_prepared(cluster: Cluster) -> None:
    """DGX-1: the empty node's ring order hands out (0,3), (1,2), then (4,5) over one NVLink while (4,7) with two
    is free; following the allocations, every pod gets a two-link pair."""
    topo = cluster.catalog.topology
    best = max(topo.gbps(a, b) for a, b in itertools.combinations(range(topo.size), 2))
    pairs = [cluster.claim(f"pod-{i}", 2) for i in range(4)]
    assert sorted(g for p in pairs for g in p) == list(range(8))
    assert [topo.gbps(*p) for p in pairs] == [best] * 4, pairs


def test_other_pools_do_not_count_and_a_released_allocation_frees_its_gpus(cluster: Cluster) -> None:
    first = cluster.ring_order()[:2]
    # someone else's driver, and another node's pool of ours, naming the devices our first pair would be
    cluster.write_allocation("elsewhere", [
        {"request": "gpus", "driver": "other.example.com", "pool": NODE, "device": f"gpu-{first[0]}"},
        {"request": "gpus", "driver": DRIVER, "pool": "gpu-node-2", "device": f"gpu-{first[1]}"},
    ])
    cluster.write_allocation("here", [{"request": "gpus", "driver": DRIVER, "pool": NODE,
                                       "device": f"gpu-{g}"} for g in first])
    assert eventually(lambda: set(cluster.ring_order()[-2:]) == set(first), timeout=10)
    assert cluster.publisher.allocated_gpus() == set(first)
    cluster.fake.delete_claim("default", "here")  # the claim is deallocated and gone
    assert eventually(lambda: cluster.ring_order()[:2] == first, timeout=10)
    assert cluster.publisher.allocated_gpus() == set()


def test_without_rights_on_claims_the_pool_is_still_published() -> None:
    """RBAC without list/watch on resourceclaims (an older chart): the watch counts the resource as absent and the
    order follows prepares only, as before."""
    with short_dir("dra-") as root, FakeDraKubeApi() as fake:
        fake.add_node({"metadata": {"name": NODE}})
        fake.fail_next(1000, status=403, path_regex=r"^/apis/resource\.k8s\.io/v1/resourceclaims")
        api = make_api_client(host=fake.url, timeout_s=5.0)
        _, publisher = make_driver(api, Path(root))
        publisher.start()
        try:
            assert publisher.wait_syncs(1, timeout=10)
            assert fake.slices(NODE) and publisher.allocated_gpus() == set()
        finally:
            publisher.stop()
            api.close()
