"""Which sizes of the empty node can ring on NVLink alone (gputopo.core.nvlink_ring_sizes): the plugin's
`nvlink-ring-<k>` labels and the extender's `require-nvlink` test read the same answer, so an autoscaler never adds
a node for a pod the extender then refuses there for good. Checked against an exhaustive search over GPU sets and
cyclic orders, on random machines and on the real topologies."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import given, settings

from gputopo.core import Topology, min_nvlink_gbps, nvlink_ring_sizes
from gputopo.core.topology import Gpu, Link, LinkKind
from gputopo.discovery.loader import load_topology_file
from tests.gputopo.core.strategies import topologies

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "topologies"


def exhaustive(topo: Topology) -> frozenset[int]:
    """Sizes k for which some k GPUs, in some cyclic order, are joined hop by hop by links whose bandwidth reaches
    the node's slowest NVLink pair (two GPUs: one such pair)."""
    floor = min_nvlink_gbps(topo)
    if floor is None:
        return frozenset()
    bw = topo.bandwidth_mbps
    out = set()
    for k in range(2, topo.size + 1):
        for members in itertools.combinations(range(topo.size), k):
            first, rest = members[0], members[1:]
            if any(all(bw[a][b] / 1000.0 + 1e-9 >= floor for a, b in zip((first, *order), (*order, first), strict=True))
                   for order in itertools.permutations(rest)):
                out.add(k)
                break
    return frozenset(out)


@settings(max_examples=150, deadline=None)
@given(topo=topologies(min_gpus=2, max_gpus=6))
def test_the_sizes_are_those_an_exhaustive_search_finds(topo: Topology) -> None:
    assert nvlink_ring_sizes(topo) == exhaustive(topo)


def test_a_square_of_nvlinks_rings_two_and_four_gpus_but_not_three() -> None:
    """Why the label is one per size, not a largest size: no triangle in a square."""
    nv, pcie = Link(LinkKind.NVLINK, 2, 3), Link(LinkKind.SYS)
    square = {(0, 1), (1, 2), (2, 3), (0, 3)}
    links = [[None if i == j else nv if (min(i, j), max(i, j)) in square else pcie for j in range(4)]
             for i in range(4)]
    topo = Topology.build([Gpu(i, f"GPU-{i}") for i in range(4)], links)
    assert nvlink_ring_sizes(topo) == {2, 4}


@pytest.mark.parametrize(("fixture", "sizes"), [
    ("pcie-8x-rtxa6000-nvlinkbridge-pairs-2socket-unige-baobab", {2}),
    ("pcie-8x-a100-nv12-bridge-pairs-2socket-nccltests178", {2}),
    ("dgx1-v100-pytorch-ddp-bench", set(range(2, 9))),
    ("hgx-a100-8gpu-epyc7763-pleiades", set(range(2, 9))),
    ("dell-c4140-4x-v100-sxm2-nv2-alltoall-nccltests68", {2, 3, 4}),
    ("pcie-8x-rtx5090-2socket-sglang23020", set()),
])
def test_the_real_topologies(fixture: str, sizes: set[int]) -> None:
    assert nvlink_ring_sizes(load_topology_file(FIXTURES / f"{fixture}.txt")) == sizes
