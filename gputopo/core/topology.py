"""The topology model: GPUs, the link between every pair, NICs, and the derived bandwidth matrix.

A `Topology` is immutable and carries its bandwidth matrix (integer MB/s per direction) so that the allocator, the
JSON codec and both halves of the product read one computed truth. Build one with `Topology.build`, which validates
shape and symmetry and fills the matrix from `bandwidth.pair_bandwidth_mbps`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from gputopo.core import bandwidth
from gputopo.core.errors import TopologyError


class LinkKind(StrEnum):
    """How two GPUs reach each other, best first within each family."""

    NVSWITCH = "NVSWITCH"  # both attached to one NVSwitch fabric
    NVLINK = "NVLINK"  # direct bonded NVLinks (bridge or board traces)
    PIX = "PIX"
    PXB = "PXB"
    PHB = "PHB"
    NODE = "NODE"
    SYS = "SYS"

    @property
    def is_nvlink(self) -> bool:
        return self in (LinkKind.NVSWITCH, LinkKind.NVLINK)


PCIE_KINDS: tuple[LinkKind, ...] = (LinkKind.PIX, LinkKind.PXB, LinkKind.PHB, LinkKind.NODE, LinkKind.SYS)
# Above any NIC made (1.6 Tb/s is the fastest port announced): a larger figure is a unit mistake, not a NIC.
MAX_NIC_GBIT = 6400.0


@dataclass(frozen=True, slots=True)
class Link:
    """One GPU pair's connection. `lanes` counts bonded NVLinks (0 for PCIe); `generation` is the NVLink
    generation (1-5) or None for PCIe."""

    kind: LinkKind
    lanes: int = 0
    generation: int | None = None

    def __post_init__(self) -> None:
        if self.kind.is_nvlink:
            if self.lanes <= 0:
                raise TopologyError(f"{self.kind.value} link needs a positive lane count, got {self.lanes}")
            if self.generation not in bandwidth.NVLINK_GENERATIONS:
                raise TopologyError(f"unknown NVLink generation {self.generation!r}")
        elif self.lanes or self.generation is not None:
            raise TopologyError(f"PCIe link {self.kind.value} cannot carry NVLink lanes or generation")

    @property
    def label(self) -> str:
        """Short form as `nvidia-smi topo -m` writes it (NV12), with NVSwitch marked (SW18)."""
        if self.kind is LinkKind.NVLINK:
            return f"NV{self.lanes}"
        if self.kind is LinkKind.NVSWITCH:
            return f"SW{self.lanes}"
        return self.kind.value


@dataclass(frozen=True, slots=True)
class Gpu:
    index: int
    id: str
    pci_bus_id: str | None = None
    model: str | None = None
    memory_mib: int | None = None
    numa_node: int | None = None
    cpu_affinity: str | None = None


@dataclass(frozen=True, slots=True)
class Nic:
    """A NIC and its PCIe path class to each GPU: whether a GPU reaches the network with GPUDirect RDMA.

    `rdma`: an RDMA device (InfiniBand or RoCE), False for a plain Ethernet NIC, None when the source cannot say.
    `link_gbit`: line rate in Gb/s (the unit NICs are sold and reported in), None when unknown.
    """

    name: str
    gpu_links: tuple[LinkKind, ...]
    rdma: bool | None = None
    link_gbit: float | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise TopologyError("a NIC needs a name")
        bad = [k.value for k in self.gpu_links if k not in PCIE_KINDS]
        if bad:
            raise TopologyError(f"NIC {self.name} relates to GPUs over PCIe only, not {', '.join(sorted(set(bad)))}")
        rate = self.link_gbit
        number = isinstance(rate, (int, float)) and not isinstance(rate, bool)
        if rate is not None and not (number and math.isfinite(rate) and 0 < rate <= MAX_NIC_GBIT):
            raise TopologyError(f"NIC {self.name} link rate must be 0-{MAX_NIC_GBIT:g} Gb/s, got {rate!r}")


@dataclass(frozen=True)
class Topology:
    gpus: tuple[Gpu, ...]
    links: tuple[tuple[Link | None, ...], ...]
    nics: tuple[Nic, ...] = ()
    pcie_generation: int = bandwidth.DEFAULT_PCIE_GENERATION
    socket_link_gbps: float = bandwidth.DEFAULT_SOCKET_LINK_GBPS
    bandwidth_mbps: tuple[tuple[int, ...], ...] = field(default=(), compare=False)
    fingerprint: str = field(default="", compare=False)
    # GB/s each GPU reaches the network at: its best NIC path (bandwidth.gpu_nic_gbps); with no NIC listed, a NIC
    # of the assumed default rate across the socket, staged through host memory (what a GPU far from any NIC gets).
    network_gbps: tuple[float, ...] = field(default=(), compare=False)

    @classmethod
    def build(
        cls,
        gpus: Sequence[Gpu],
        links: Sequence[Sequence[Link | None]],
        nics: Sequence[Nic] = (),
        pcie_generation: int = bandwidth.DEFAULT_PCIE_GENERATION,
        socket_link_gbps: float = bandwidth.DEFAULT_SOCKET_LINK_GBPS,
    ) -> Topology:
        """Validate and derive the bandwidth matrix and fingerprint. `links[i][i]` must be None."""
        n = len(gpus)
        if n == 0:
            raise TopologyError("a topology needs at least one GPU")
        for i, g in enumerate(gpus):
            if g.index != i:
                raise TopologyError(f"GPU at position {i} has index {g.index}; indices must be 0..{n - 1}")
        ids = [g.id for g in gpus]
        if len(set(ids)) != n:
            dup = sorted({x for x in ids if ids.count(x) > 1})
            raise TopologyError(f"duplicate GPU ids: {', '.join(dup)}")
        if len(links) != n or any(len(row) != n for row in links):
            raise TopologyError(f"link matrix must be {n}x{n}")
        for i in range(n):
            if links[i][i] is not None:
                raise TopologyError(f"link matrix diagonal at GPU{i} must be empty (self)")
            for j in range(i + 1, n):
                a, b = links[i][j], links[j][i]
                if a is None or b is None:
                    raise TopologyError(f"missing link between GPU{i} and GPU{j}")
                if a != b:
                    raise TopologyError(f"asymmetric link GPU{i}-GPU{j}: {a.label} vs {b.label}")
        for nic in nics:
            if len(nic.gpu_links) != n:
                raise TopologyError(f"NIC {nic.name} relates to {len(nic.gpu_links)} GPUs, expected {n}")
        if pcie_generation not in bandwidth.PCIE_X16_GBPS:
            raise TopologyError(f"unknown PCIe generation {pcie_generation}")
        if not socket_link_gbps > 0:
            raise TopologyError(f"socket interconnect bandwidth must be positive, got {socket_link_gbps}")
        frozen_links = tuple(tuple(row) for row in links)
        bw = tuple(
            tuple(
                0 if i == j else bandwidth.pair_bandwidth_mbps(frozen_links[i][j], pcie_generation, socket_link_gbps)
                for j in range(n)
            )
            for i in range(n)
        )
        topo = cls(
            gpus=tuple(gpus),
            links=frozen_links,
            nics=tuple(nics),
            pcie_generation=pcie_generation,
            socket_link_gbps=socket_link_gbps,
            bandwidth_mbps=bw,
            network_gbps=_network_gbps(nics, n, pcie_generation, socket_link_gbps),
        )
        object.__setattr__(topo, "fingerprint", _fingerprint(topo))
        return topo

    @property
    def size(self) -> int:
        return len(self.gpus)

    @property
    def ids(self) -> tuple[str, ...]:
        return tuple(g.id for g in self.gpus)

    def index_of(self, gpu_id: str) -> int:
        for g in self.gpus:
            if g.id == gpu_id:
                return g.index
        raise KeyError(gpu_id)

    def indices_of(self, gpu_ids: Iterable[str]) -> list[int]:
        lookup = {g.id: g.index for g in self.gpus}
        return [lookup[x] for x in gpu_ids]

    def gbps(self, i: int, j: int) -> float:
        return self.bandwidth_mbps[i][j] / 1000.0

    def link(self, i: int, j: int) -> Link:
        link = self.links[i][j]
        if link is None:
            raise TopologyError(f"GPU{i} has no link to itself")
        return link

    @property
    def fabric(self) -> str:
        """nvswitch, nvlink or pcie: the best interconnect kind present, for node labels."""
        kinds = {link.kind for row in self.links for link in row if link is not None}
        if LinkKind.NVSWITCH in kinds:
            return "nvswitch"
        if LinkKind.NVLINK in kinds:
            return "nvlink"
        return "pcie"

    def nvlink_islands(self) -> list[list[int]]:
        """Connected components over NVLink/NVSwitch links, largest first."""
        seen: set[int] = set()
        islands: list[list[int]] = []
        for start in range(self.size):
            if start in seen:
                continue
            stack, comp = [start], []
            seen.add(start)
            while stack:
                i = stack.pop()
                comp.append(i)
                for j in range(self.size):
                    link = self.links[i][j]
                    if j not in seen and link is not None and link.kind.is_nvlink:
                        seen.add(j)
                        stack.append(j)
            islands.append(sorted(comp))
        islands.sort(key=lambda c: (-len(c), c))
        return islands


def _network_gbps(nics: Sequence[Nic], n: int, pcie_generation: int, socket_link_gbps: float) -> tuple[float, ...]:
    def best(i: int) -> float:
        if not nics:
            return bandwidth.gpu_nic_gbps(LinkKind.SYS.value, None, None, pcie_generation, socket_link_gbps)
        return max(
            bandwidth.gpu_nic_gbps(nic.gpu_links[i].value, nic.rdma, nic.link_gbit, pcie_generation, socket_link_gbps)
            for nic in nics
        )

    return tuple(best(i) for i in range(n))


def _fingerprint(topo: Topology) -> str:
    """Identity of what placement sees (bandwidths, NUMA, each GPU's network rate), not of names: nodes of one model
    share it, and a cache keyed on it never mixes up two nodes whose NICs differ."""
    h = hashlib.sha256()
    h.update(repr(topo.bandwidth_mbps).encode())
    h.update(repr(tuple(g.numa_node for g in topo.gpus)).encode())
    h.update(repr(topo.network_gbps).encode())
    return h.hexdigest()[:16]
