"""Allocator behaviour through its public interface: fixtures, errors, size 1, must_include, large nodes."""

from __future__ import annotations

import random

import pytest

from gputopo.core import AllocationError, best_subset, efficiency_vs_empty
from gputopo.core.allocator import best_possible_gbps
from gputopo.core.topology import Gpu, Link, LinkKind, Topology
from gputopo.discovery.loader import load_topology_file
from sim.machines import nvlink_domains, nvswitch_node, pcie_bridge_server
from tests.gputopo.core.reference import exhaustive_best
from tests.gputopo.core.test_allocator_exact import check
from tests.helpers.paths import SHARED

FIXTURES = sorted(p for p in (SHARED / "topologies").glob("*.txt") if "PARTIAL" not in p.name)


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: p.stem)
def test_every_shared_fixture_matches_exhaustive(path) -> None:
    topo = load_topology_file(path)
    rng = random.Random(path.stem)
    for size in range(1, topo.size + 1):
        check(topo, list(range(topo.size)), size, [])
    for _ in range(25):
        taken = set(rng.sample(range(topo.size), rng.randint(1, topo.size // 2)))
        avail = [i for i in range(topo.size) if i not in taken]
        size = rng.randint(1, len(avail))
        must = rng.sample(avail, rng.randint(0, min(2, size)))
        check(topo, avail, size, sorted(must))


def _dgx1():
    return load_topology_file(SHARED / "topologies" / "dgx1-v100-ucxpy.txt")


def test_pair_on_dgx1_is_a_double_nvlink() -> None:
    alloc = best_subset(_dgx1(), range(8), 2)
    topo = _dgx1()
    assert topo.link(*alloc.gpus).lanes == 2
    assert alloc.allreduce_gbps == pytest.approx(40.0)


def test_size_one_takes_the_orphan_not_half_of_a_free_nvlink_pair() -> None:
    topo = _dgx1()
    # Free: 0 and 3 (an NV2 pair) and 5 (whose NVLink peers are all taken).
    alloc = best_subset(topo, [0, 3, 5], 1)
    assert alloc.gpus == (5,)
    # And on a bridge-pair PCIe server: one GPU of a free bridged pair stays with its partner.
    bridges = load_topology_file(SHARED / "topologies" / "pcie-8x-rtxa6000-nvlinkbridge-pairs-2socket-unige-baobab.txt")
    assert best_subset(bridges, [0, 1, 2], 1).gpus == (2,)


def test_must_include_is_honoured_and_scored() -> None:
    topo = _dgx1()
    alloc = best_subset(topo, range(8), 2, must_include=[5])
    assert 5 in alloc.gpus
    assert topo.link(*alloc.gpus).lanes == 2
    # 5 has NV2 to 1 (other socket) and to 6 (same socket): NUMA breaks the tie.
    assert alloc.gpus == (5, 6)


@pytest.mark.parametrize(
    ("available", "size", "must", "message"),
    [
        ([0, 1], 0, [], "size must be positive"),
        ([0, 1], -1, [], "size must be positive"),
        ([0, 1], 3, [], "exceeds the 2 available"),
        ([0, 1, 1], 1, [], "twice"),
        ([0, 9], 1, [], "outside 0..7"),
        ([0, -1], 1, [], "outside 0..7"),
        ([0, 1], 1, [2], "not available"),
        ([0, 1, 2], 1, [0, 1], "more than the size"),
        ([0, "1"], 1, [], "not a GPU index"),
        ([0, True], 1, [], "not a GPU index"),
        ([0, 1], 1.5, [], "must be an integer"),
    ],
)
def test_bad_arguments_raise_a_typed_error(available, size, must, message) -> None:
    with pytest.raises(AllocationError, match=message):
        best_subset(_dgx1(), available, size, must)


def test_numpy_indices_are_accepted() -> None:
    import numpy as np

    assert best_subset(_dgx1(), np.arange(8), 2).gpus == best_subset(_dgx1(), list(range(8)), 2).gpus


@pytest.mark.parametrize(
    "topo",
    [nvswitch_node(72, 18, 5, numa_nodes=4), nvlink_domains(32, 8, 18, 4), pcie_bridge_server(32)],
    ids=["nvl72", "32-domains", "32-pcie"],
)
def test_large_nodes_give_valid_subsets_near_their_bound(topo: Topology) -> None:
    rng = random.Random(3)
    for _ in range(15):
        taken = set(rng.sample(range(topo.size), rng.randint(0, topo.size // 2)))
        avail = [i for i in range(topo.size) if i not in taken]
        size = rng.choice([s for s in (1, 2, 3, 4, 8, 16) if s <= len(avail)])
        must = rng.sample(avail, 1) if rng.random() < 0.3 else []
        alloc = best_subset(topo, avail, size, must)
        assert len(alloc.gpus) == size == len(set(alloc.gpus))
        assert set(must) <= set(alloc.gpus) <= set(avail)
        if size >= 2:
            assert alloc.allreduce_gbps <= alloc.bound_gbps + 1e-9


def test_large_nodes_find_the_whole_domain_when_it_is_free() -> None:
    topo = nvlink_domains(32, 8, 18, 4)
    alloc = best_subset(topo, range(32), 8)
    assert alloc.allreduce_gbps == alloc.bound_gbps
    assert len({g // 8 for g in alloc.gpus}) == 1


def test_placement_efficiency_is_relative_to_the_empty_node() -> None:
    topo = _dgx1()
    assert efficiency_vs_empty(topo, [0, 3]) == pytest.approx(1.0)
    assert efficiency_vs_empty(topo, [0, 5]) == pytest.approx(7.2 / 40.0)
    assert efficiency_vs_empty(topo, [4]) == 1.0
    assert best_possible_gbps(topo, 4) == pytest.approx(20.0)


def test_any_nvlink_pair_beats_any_pcie_pair_even_when_degraded() -> None:
    n = 3
    links = [[None] * n for _ in range(n)]
    links[0][1] = links[1][0] = Link(LinkKind.NVLINK, 1, 4)
    links[0][2] = links[2][0] = Link(LinkKind.PIX)
    links[1][2] = links[2][1] = Link(LinkKind.PIX)
    topo = Topology.build([Gpu(i, f"g{i}") for i in range(n)], links, pcie_generation=5)
    assert topo.gbps(0, 1) > topo.gbps(0, 2)
    assert best_subset(topo, range(3), 2).gpus == (0, 1)


def test_reference_itself_detects_a_wrong_answer() -> None:
    """Guard against a vacuous oracle: the exhaustive score of a bad subset is lower."""
    topo = _dgx1()
    best, chosen = exhaustive_best(topo, list(range(8)), 2)
    assert chosen == (0, 3) and best[0] == 40000
