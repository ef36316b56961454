"""Hypothesis strategies for random but physically shaped topologies.

Links and NUMA come from a seeded random generator rather than element-wise draws: hypothesis then explores whole
differently-wired machines (its element-wise draws cluster on near-uniform matrices that hide ordering bugs).
"""

from __future__ import annotations

import random

from hypothesis import strategies as st

from gputopo.core.topology import Gpu, Link, LinkKind, Topology

PCIE = [LinkKind.PIX, LinkKind.PXB, LinkKind.PHB, LinkKind.NODE, LinkKind.SYS]


def random_topology(rng: random.Random, n: int) -> Topology:
    gen = rng.choice([1, 2, 3, 4, 5])
    style = rng.choice(["mixed", "pcie", "islands", "switch"])
    island = [rng.randrange(3) for _ in range(n)]
    matrix: list[list[Link | None]] = [[None] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            if style == "pcie" or (style == "islands" and island[i] != island[j]):
                link = Link(rng.choice(PCIE))
            elif style == "switch":
                link = Link(LinkKind.NVSWITCH, rng.choice([12, 18, 18]), gen)
            elif style == "islands" or rng.random() < 0.5:
                link = Link(LinkKind.NVLINK, rng.randint(1, 4), gen)
            else:
                link = Link(rng.choice(PCIE))
            matrix[i][j] = matrix[j][i] = link
    numa_mode = rng.choice(["none", "split", "random"])
    gpus = []
    for i in range(n):
        numa = None if numa_mode == "none" else (i * 2 // n if numa_mode == "split" else rng.randrange(3))
        gpus.append(Gpu(i, f"GPU-{i:04d}", numa_node=numa))
    return Topology.build(
        gpus, matrix, pcie_generation=rng.choice([3, 4, 5]), socket_link_gbps=rng.choice([6.0, 10.0, 16.0, 24.0])
    )


@st.composite
def topologies(draw, min_gpus: int = 2, max_gpus: int = 8) -> Topology:
    n = draw(st.integers(min_gpus, max_gpus))
    return random_topology(random.Random(draw(st.integers(0, 2**32))), n)


@st.composite
def requests(draw, topo: Topology):
    """(available, size, must_include) that the allocator must accept, biased to mostly-free nodes and mid sizes."""
    n = topo.size
    taken = draw(st.lists(st.integers(0, n - 1), max_size=max(0, n - 2), unique=True))
    avail = sorted(set(range(n)) - set(taken)) or [0]
    size = draw(st.integers(1, len(avail)))
    must = draw(st.lists(st.sampled_from(avail), max_size=min(size, 2), unique=True)) if draw(st.booleans()) else []
    return avail, size, sorted(must)
