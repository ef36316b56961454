"""Synthetic machines for benchmarks and simulations where no real `nvidia-smi topo -m` of that size is at hand.

Each builder states which real system it imitates; the shared fixtures stay the first choice wherever one exists.
"""

from __future__ import annotations

from gputopo.core import Gpu, Link, LinkKind, Topology


def nvswitch_node(n: int, lanes: int, generation: int, numa_nodes: int = 2, model: str | None = None) -> Topology:
    """Every GPU on one NVSwitch fabric: DGX-2 (16x V100, NV6, gen 2), GB200 NVL72 (72, NV18, gen 5)."""
    links = [[None if i == j else Link(LinkKind.NVSWITCH, lanes, generation) for j in range(n)] for i in range(n)]
    gpus = [Gpu(i, f"GPU-{i:02d}", model=model, numa_node=i * numa_nodes // n) for i in range(n)]
    pcie = {1: 3, 2: 3, 3: 4, 4: 5, 5: 5}[generation]
    return Topology.build(gpus, links, pcie_generation=pcie)


def pcie_bridge_server(n: int, bridge_lanes: int = 4, generation: int = 3) -> Topology:
    """PCIe server with NVLink-bridged pairs, PCIe switches of 4 GPUs, two sockets: 8-16x A6000/A40 class."""
    links: list[list[Link | None]] = [[None] * n for _ in range(n)]
    half = n // 2
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            if i // 2 == j // 2:
                link = Link(LinkKind.NVLINK, bridge_lanes, generation)
            elif i // 4 == j // 4:
                link = Link(LinkKind.PIX)
            elif i // half == j // half:
                link = Link(LinkKind.NODE)
            else:
                link = Link(LinkKind.SYS)
            links[i][j] = link
    gpus = [Gpu(i, f"GPU-{i:02d}", numa_node=i // half) for i in range(n)]
    return Topology.build(gpus, links, pcie_generation=4)


def nvlink_domains(n: int, domain: int, lanes: int, generation: int) -> Topology:
    """Several NVSwitch domains joined over PCIe/SYS (a 32-GPU node of four 8-GPU boards)."""
    links: list[list[Link | None]] = [[None] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i != j:
                same = i // domain == j // domain
                links[i][j] = Link(LinkKind.NVSWITCH, lanes, generation) if same else Link(LinkKind.SYS)
    gpus = [Gpu(i, f"GPU-{i:02d}", numa_node=i // domain) for i in range(n)]
    return Topology.build(gpus, links, pcie_generation=5)
