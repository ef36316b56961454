"""The one table of link bandwidth estimates, in GB/s per direction, with where each figure comes from.

Sources (collected in fixtures/topologies/SOURCES.md):
- NVLink per-link figures are NCCL's own effective model (NVIDIA/nccl src/graph/topo.h: SM60 18.0, SM70 20.0,
  SM80 20.0, SM90 20.6, SM100 40.1), which predicts all-reduce bus bandwidth better than the 25/50 GB/s line rate:
  18 x 20.6 = 370.8 GB/s is what NCCL logs on H100 (nccl#1519), and 328 GB/s was measured on the 2x H200 recording.
- PCIe x16: NCCL assumes 12 GB/s for Gen3 and prints 24 GB/s for Gen4 and for Gen5 switch links (nccl-tests#100,
  nccl#1519). Measured Gen5 through host memory on the H200 recording: 25.8 GB/s busbw.
- PCIe path classes are ranked PIX > PXB > PHB > NODE > SYS by fixed fractions of the x16 figure (each extra bridge
  or host-bridge crossing costs P2P throughput; nccl-tests#178 shows ~20 GB/s once a Gen4 ring leaves a switch).
  SYS is further capped by the socket interconnect (NCCL: Intel UPI 10, AMD xGMI Zen3/4 24; default 16 here).

Between pods and nodes (the job model, gputopo.core.jobs); which figures were measured here is said at each:
- Host path between two pods on one node: MEASURED HERE, 2x H200 (fixtures/recordings/README.md).
- NIC path of a GPU: GPUDirect RDMA at the NIC's line rate when the NIC is an RDMA device on the GPU's PCIe switch
  (PIX/PXB); otherwise staged through host memory. Not measured here (no multi-node machine).
- Oversubscription per network locality level crossed: an assumption, configurable; not measured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gputopo.core.topology import Link

# NVLink generation -> effective GB/s per link per direction.
NVLINK_LANE_GBPS: dict[int, float] = {1: 18.0, 2: 20.0, 3: 20.0, 4: 20.6, 5: 40.1}
NVLINK_GENERATIONS = frozenset(NVLINK_LANE_GBPS)
# Links per GPU of each generation's flagship part (P100, V100, A100, H100, B200): used to tell an NVSwitch fabric
# from direct links in `nvidia-smi topo -m` text, where both print as NV#.
NVLINK_LINKS_PER_GPU: dict[int, int] = {1: 4, 2: 6, 3: 12, 4: 18, 5: 18}

# PCIe generation -> effective x16 GB/s per direction.
PCIE_X16_GBPS: dict[int, float] = {3: 12.0, 4: 24.0, 5: 24.0, 6: 48.0}
DEFAULT_PCIE_GENERATION = 4
DEFAULT_SOCKET_LINK_GBPS = 16.0

PCIE_CLASS_FRACTION: dict[str, float] = {"PIX": 1.0, "PXB": 0.9, "PHB": 0.8, "NODE": 0.7, "SYS": 0.6}

# Which PCIe generation ships beside each NVLink generation (P100/V100 Gen3, A100 Gen4, H100/B200 Gen5).
PCIE_GENERATION_FOR_NVLINK: dict[int, int] = {1: 3, 2: 3, 3: 4, 4: 5, 5: 5}

# NVML's nvmlDeviceGetNvLinkVersion enumeration -> NVLink generation (NVML_NVLINK_VERSION_1_0 = 1, 2_0 = 2,
# 2_2 = 3, 3_0 = 4, 3_1 = 5, 4_0 = 6, 5_0 = 7). The H200 recording reports 6 = NVLink 4.0.
NVML_NVLINK_VERSION_TO_GENERATION: dict[int, int] = {1: 1, 2: 2, 3: 2, 4: 3, 5: 3, 6: 4, 7: 5}

_MODEL_GENERATION: tuple[tuple[str, int], ...] = (
    ("GB300", 5),
    ("GB200", 5),
    ("B300", 5),
    ("B200", 5),
    ("B100", 5),
    ("GH200", 4),
    ("H200", 4),
    ("H100", 4),
    ("H800", 4),
    ("H20", 4),
    ("A100", 3),
    ("A800", 3),
    ("A30", 3),
    ("A40", 3),
    ("A6000", 3),
    ("A5000", 3),
    ("V100", 2),
    ("PG503", 2),
    ("P100", 1),
)


def nvlink_generation_for_model(model: str | None) -> int | None:
    """NVLink generation implied by a GPU model name, or None when the name says nothing."""
    if not model:
        return None
    upper = model.upper()
    for needle, gen in _MODEL_GENERATION:
        if needle in upper:
            return gen
    return None


def pcie_class_gbps(kind: str, pcie_generation: int, socket_link_gbps: float) -> float:
    x16 = PCIE_X16_GBPS[pcie_generation]
    value = x16 * PCIE_CLASS_FRACTION[kind]
    if kind == "SYS":
        value = min(value, socket_link_gbps)
    return value


def link_gbps(link: Link, pcie_generation: int, socket_link_gbps: float) -> float:
    """Estimated GB/s per direction of one pair.

    A pair with live NVLinks also has its PCIe path, so it is never estimated below the best PCIe class: degraded
    NVLink (most lanes down) still ranks above every PCIe pair, as the quality model requires.
    """
    if link.kind.is_nvlink:
        assert link.generation is not None
        nv = link.lanes * NVLINK_LANE_GBPS[link.generation]
        return max(nv, PCIE_X16_GBPS[pcie_generation] + 1.0)
    return pcie_class_gbps(link.kind.value, pcie_generation, socket_link_gbps)


def pair_bandwidth_mbps(link: Link | None, pcie_generation: int, socket_link_gbps: float) -> int:
    """Integer MB/s, so that sums and comparisons in the allocator are exact."""
    if link is None:
        return 0
    return round(link_gbps(link, pcie_generation, socket_link_gbps) * 1000)


# -- between pods and between nodes ------------------------------------------------------------------------------

# Two pods on one node each see only their own GPUs: CUDA IPC needs the peer GPU visible, so NCCL falls back to
# shared memory through the host (NCCL issues #324, #945). MEASURED HERE: NCCL all-reduce bus bandwidth, 2 ranks,
# 1 GiB, NCCL_P2P_DISABLE=1 on 2x H200 = 25.8 GB/s (fixtures/recordings/README.md); a later run of bench/nccl.py
# gave 27.4 (bench/results/nccl-h200x2.md). The lower figure is kept. Until the pod-to-pod calibration lands it
# stands for every machine, whatever its PCIe generation, and for pods of any size.
HOST_PATH_GBPS = 25.8

# PCIe path classes at which a GPU reaches an RDMA NIC with GPUDirect RDMA: the NIC under the GPU's own PCIe switch
# (one switch PIX, or several PXB). Beyond them (PHB, NODE, SYS) traffic crosses the CPU's host bridge, where NCCL's
# NCCL_NET_GDR_LEVEL path types stop using GPUDirect by default, and NVIDIA's GPUDirect RDMA manual asks for GPU and
# HCA on the same PCIe root complex; data is then staged through host memory.
GDR_CLASSES = frozenset({"PIX", "PXB"})

# ASSUMED when a NIC's line rate is unknown (`nvidia-smi topo -m` text names NICs but not their rate): 100 Gb/s,
# the slowest NIC among the shared fixtures that document theirs (fixtures/topologies/SOURCES.md: DGX-1 4x EDR
# 100 Gb/s, deepep13 8x 100G RoCE). A DGX H100 has 400 Gb/s per GPU (the 50 GB/s per GPU).
DEFAULT_NIC_GBIT = 100.0

# ASSUMED: each network locality level a ring edge crosses (rack -> spine -> core -> zone) keeps this share of the
# bandwidth: 0.5 is a 2:1 oversubscribed uplink. Training fabrics are often built non-blocking (1:1, factor 1.0)
# inside a scalable unit and oversubscribed above it; 2:1-3:1 is the common figure for oversubscribed east-west
# fabrics (aidatacenterguide.com, ch. 8.5 "Scale-Out Topology, Sizing & Oversubscription"). Not measured;
# configurable per level (gputopo.core.locality).
DEFAULT_LEVEL_FACTOR = 0.5


def nic_line_gbps(link_gbit: float | None) -> float:
    """A NIC's line rate in GB/s per direction (Gb/s / 8); the assumed default when unknown."""
    return (link_gbit if link_gbit is not None else DEFAULT_NIC_GBIT) / 8.0


def gpu_nic_gbps(kind: str, rdma: bool | None, link_gbit: float | None, pcie_generation: int,
                 socket_link_gbps: float) -> float:
    """GB/s one GPU sends to the network through one NIC at PCIe path class `kind`.

    GPUDirect RDMA (an RDMA NIC on the GPU's switch) runs at line rate. Otherwise the data is staged through host
    memory: no faster than the host path, than the PCIe class between GPU and NIC, or than the line. An RDMA flag of
    None counts as RDMA: the NICs `nvidia-smi topo -m` lists are RDMA devices (NVML enumerates them as such, so a
    SoftiWARP device appears there too: NVIDIA/NVSentinel#1485). A plain Ethernet NIC (NCCL's socket transport) is
    given the staged figure, an upper bound: its real rate is not measured here.
    """
    line = nic_line_gbps(link_gbit)
    if rdma is not False and kind in GDR_CLASSES:
        return line
    return min(line, HOST_PATH_GBPS, pcie_class_gbps(kind, pcie_generation, socket_link_gbps))
