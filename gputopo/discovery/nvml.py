"""Build the core Topology from what NVML says: one code path for live NVML and for replayed recordings.

How NVML's answers become links (the facts behind each rule are in docs/DESIGN.md "Discovery facts that
bite"):
- Direct NVLink: an active link whose remote PCI bus id is another visible GPU. Lanes = active links to that
  peer; links that are down simply do not count, which lowers the pair's bandwidth.
- NVSwitch: an active link whose remote end is a switch (remote type NVSwitch, or the bus id FFFFFFFF:FF:FF.0
  that NVSwitch systems report). Two GPUs that both have active switch links reach each other through the
  fabric at the smaller of their switch-link counts, unless NVML's P2P status over NVLink says they cannot
  (fabric partitions); an unknown P2P status does not veto.
- Everything else: the PCIe common ancestor (NVML's topology level, the same scale as `nvidia-smi topo -m`).
- MIG-enabled GPUs are left out of the topology (their slices are not whole devices) and reported in
  `NodeDiscovery.excluded`; what NVML says about their MIG devices is in `NodeDiscovery.mig` (and in
  `DiscoveryError.mig` when no whole GPU is left), from `gputopo.discovery.nvml_mig`.

Any single failed call means "unknown" and degrades that fact alone (NUMA None, PCIe SYS, generation from the
model name); only a failed device count, or no usable GPU at all, stops discovery.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import structlog

from gputopo.core import bandwidth
from gputopo.core.errors import CoreError
from gputopo.core.topology import Gpu, Link, LinkKind, Topology
from gputopo.discovery.nvml_backend import (
    ERR_INVALID_ARGUMENT,
    ERR_NOT_SUPPORTED,
    NVML_DEVICE_MIG_ENABLE,
    NVML_FEATURE_ENABLED,
    NVML_NVLINK_DEVICE_TYPE_GPU,
    NVML_NVLINK_DEVICE_TYPE_IBMNPU,
    NVML_NVLINK_DEVICE_TYPE_SWITCH,
    NVML_NVLINK_MAX_LINKS,
    NVML_P2P_CAPS_INDEX_NVLINK,
    NVML_P2P_STATUS_OK,
    NVML_TOPOLOGY_HOSTBRIDGE,
    NVML_TOPOLOGY_MULTIPLE,
    NVML_TOPOLOGY_NODE,
    NVML_TOPOLOGY_SYSTEM,
    NVSWITCH_REMOTE_BUS_ID,
    NvmlBackend,
    NvmlError,
    normalize_bus_id,
)
from gputopo.discovery.nvml_mig import MigGpu, discover_mig

log = structlog.get_logger(__name__)
T = TypeVar("T")


class DiscoveryError(Exception):
    """Discovery cannot give a topology at all (NVML has no device count, or no GPU is usable)."""

    def __init__(self, message: str, *, excluded: Sequence[ExcludedGpu] = (), mig: Sequence[MigGpu] = ()) -> None:
        self.excluded = tuple(excluded)
        self.mig = tuple(mig)
        super().__init__(message)


@dataclass(frozen=True, slots=True)
class DiscoveredGpu:
    """What the plugin needs beyond the Topology: NVML index (NVIDIA_VISIBLE_DEVICES by index), minor (/dev/nvidiaN)."""

    nvml_index: int
    uuid: str
    minor: int | None
    pci_bus_id: str | None
    compute_capability: tuple[int, int] | None


@dataclass(frozen=True, slots=True)
class ExcludedGpu:
    nvml_index: int
    uuid: str | None
    pci_bus_id: str | None
    reason: str


@dataclass(frozen=True)
class NodeDiscovery:
    """`devices[k]` describes `topology.gpus[k]` (topology indices are contiguous; NVML indices skip excluded GPUs)."""

    topology: Topology
    devices: tuple[DiscoveredGpu, ...]
    excluded: tuple[ExcludedGpu, ...] = ()
    driver_version: str | None = None
    mig: tuple[MigGpu, ...] = ()  # GPUs with MIG enabled or pending (enabled ones are also in `excluded`)

    def nvml_index_to_id(self) -> dict[int, str]:
        return {d.nvml_index: g.id for d, g in zip(self.devices, self.topology.gpus, strict=True)}


@dataclass
class _GpuFacts:
    nvml_index: int
    uuid: str
    name: str | None
    bus: str | None
    minor: int | None
    memory_mib: int | None
    numa: int | None
    affinity: str | None
    pcie_max_gen: int | None
    compute_capability: tuple[int, int] | None
    # Active links: (NVML link number, NVLink generation or None, remote bus id or None, remote type or None)
    links: list[tuple[int, int | None, str | None, int | None]] = field(default_factory=list)


def _try(fn: Callable[..., T], *args: Any, expected: tuple[str, ...] = ()) -> T | None:
    """The call's answer, or None when NVML could not say. Failures named in `expected` are normal (a link number
    the GPU does not have) and not logged."""
    try:
        return fn(*args)
    except NvmlError as e:
        if e.name not in expected:
            log.debug("discovery.nvml.call_failed", call=e.call, gpu=e.gpu, error=e.name, message=e.message)
        return None


def discover(backend: NvmlBackend) -> Topology:
    """The node's Topology (GPU ids are UUIDs). See `discover_node` for excluded GPUs and NVML indices."""
    return discover_node(backend).topology


def discover_node(backend: NvmlBackend) -> NodeDiscovery:
    """Ask NVML about every GPU and pair. `backend.init()` must have been called."""
    try:
        count = backend.device_count()
    except NvmlError as e:
        raise DiscoveryError(f"NVML cannot count GPUs: {e}") from e
    if count <= 0:
        raise DiscoveryError("NVML reports no GPUs on this node")
    driver = _try(backend.driver_version)
    facts: list[_GpuFacts] = []
    excluded: list[ExcludedGpu] = []
    mig_candidates: list[tuple[int, str]] = []
    for i in range(count):
        uuid = _try(backend.uuid, i)
        bus = _try(backend.pci_bus_id, i)
        bus = normalize_bus_id(bus) if bus else None
        if not uuid:
            excluded.append(ExcludedGpu(i, None, bus, "uuid unavailable"))
            log.warning("discovery.gpu.excluded", nvml_index=i, pci_bus_id=bus, reason="uuid unavailable")
            continue
        mig = _try(backend.mig_mode, i, expected=(ERR_NOT_SUPPORTED,))
        if mig is not None and NVML_DEVICE_MIG_ENABLE in mig:
            mig_candidates.append((i, uuid))
        if mig is not None and mig[0] == NVML_DEVICE_MIG_ENABLE:
            excluded.append(ExcludedGpu(i, uuid, bus, "MIG enabled"))
            log.warning(
                "discovery.gpu.excluded",
                nvml_index=i,
                uuid=uuid,
                pci_bus_id=bus,
                reason="MIG enabled",
                hint="not a whole GPU: its MIG devices are served per the MIG strategy (gpuplugin run --mig-strategy)",
            )
            continue
        facts.append(_gpu_facts(backend, i, uuid, bus))
    mig_gpus = discover_mig(backend, mig_candidates)
    if not facts:
        raise DiscoveryError(
            f"no usable GPU among {count} ({len(excluded)} excluded)", excluded=excluded, mig=mig_gpus
        )

    links = _pair_links(backend, facts)
    gpus = [Gpu(k, f.uuid, f.bus, f.name, f.memory_mib, f.numa, f.affinity) for k, f in enumerate(facts)]
    pcie = _pcie_generation(facts, links)
    try:
        topo = Topology.build(gpus, links, pcie_generation=pcie)
    except CoreError as e:
        raise DiscoveryError(f"NVML answers do not form a valid topology: {e}", excluded=excluded, mig=mig_gpus) from e
    devices = tuple(DiscoveredGpu(f.nvml_index, f.uuid, f.minor, f.bus, f.compute_capability) for f in facts)
    log.info(
        "discovery.nvml.done",
        gpus=topo.size,
        fabric=topo.fabric,
        excluded=len(excluded),
        links=sorted({topo.link(i, j).label for i in range(topo.size) for j in range(i + 1, topo.size)}),
    )
    return NodeDiscovery(topo, devices, tuple(excluded), driver, mig_gpus)


def _gpu_facts(backend: NvmlBackend, i: int, uuid: str, bus: str | None) -> _GpuFacts:
    memory = _try(backend.memory_total, i)
    cc = _try(backend.cuda_compute_capability, i)
    words = _try(backend.cpu_affinity, i)
    facts = _GpuFacts(
        nvml_index=i,
        uuid=uuid,
        name=_try(backend.name, i) or None,
        bus=bus,
        minor=_try(backend.minor_number, i),
        memory_mib=memory // (1024 * 1024) if memory is not None else None,
        numa=_numa_node(backend, i),
        affinity=format_cpu_set(words) if words is not None else None,
        pcie_max_gen=_try(backend.max_pcie_link_generation, i),
        compute_capability=(int(cc[0]), int(cc[1])) if cc is not None else None,
    )
    for link in range(NVML_NVLINK_MAX_LINKS):
        state = _try(backend.nvlink_state, i, link, expected=(ERR_INVALID_ARGUMENT, ERR_NOT_SUPPORTED))
        if state != NVML_FEATURE_ENABLED:
            continue
        version = _try(backend.nvlink_version, i, link)
        remote = _try(backend.nvlink_remote_pci_bus_id, i, link)
        rtype = _try(backend.nvlink_remote_device_type, i, link)
        facts.links.append((link, _nvlink_generation(version), normalize_bus_id(remote) if remote else None, rtype))
    return facts


def _numa_node(backend: NvmlBackend, i: int) -> int | None:
    """NVML's NUMA id, else the kernel's (sysfs); -1 or unknown means None (VMs, single-node hosts)."""
    for source in (backend.numa_node_id, backend.sysfs_numa_node):
        value = _try(source, i)
        if value is not None:
            return value if value >= 0 else None
    return None


def format_cpu_set(words: Sequence[int]) -> str | None:
    """64-bit mask words (CPU 0 = bit 0 of word 0) as a cpuset list ("0-19,40-59"); None for an empty mask."""
    cpus = [w * 64 + b for w, word in enumerate(words) for b in range(64) if word >> b & 1]
    if not cpus:
        return None
    ranges: list[str] = []
    start = prev = cpus[0]
    for c in [*cpus[1:], None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        ranges.append(f"{start}" if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(ranges)


def _nvlink_generation(version: int | None) -> int | None:
    if version is None:
        return None
    gen = bandwidth.NVML_NVLINK_VERSION_TO_GENERATION.get(version)
    if gen is None and version > max(bandwidth.NVML_NVLINK_VERSION_TO_GENERATION):
        gen = max(bandwidth.NVLINK_GENERATIONS)  # newer than this build knows: at least the newest rate
        log.warning("discovery.nvlink.version_unknown", nvml_version=version, assumed_generation=gen)
    return gen


def _pcie_kind(level: int | None) -> LinkKind:
    """NVML topology level -> PCIe class. Unknown (or a level between the named ones) rounds towards worse."""
    if level is None or level >= NVML_TOPOLOGY_SYSTEM:
        return LinkKind.SYS
    if level >= NVML_TOPOLOGY_NODE:
        return LinkKind.NODE
    if level >= NVML_TOPOLOGY_HOSTBRIDGE:
        return LinkKind.PHB
    if level >= NVML_TOPOLOGY_MULTIPLE:
        return LinkKind.PXB
    return LinkKind.PIX  # INTERNAL (two GPUs on one board) and SINGLE


def _pair_links(backend: NvmlBackend, facts: list[_GpuFacts]) -> list[list[Link | None]]:
    n = len(facts)
    by_bus = {f.bus: k for k, f in enumerate(facts) if f.bus}
    direct = [[0] * n for _ in range(n)]
    direct_gens: dict[tuple[int, int], set[int | None]] = {}
    switch = [0] * n
    switch_gens: list[set[int | None]] = [set() for _ in range(n)]
    for k, f in enumerate(facts):
        for link, gen, remote, rtype in f.links:
            if rtype == NVML_NVLINK_DEVICE_TYPE_SWITCH or remote == NVSWITCH_REMOTE_BUS_ID:
                switch[k] += 1
                switch_gens[k].add(gen)
            elif remote is not None and remote in by_bus and rtype in (None, NVML_NVLINK_DEVICE_TYPE_GPU):
                peer = by_bus[remote]
                direct[k][peer] += 1
                direct_gens.setdefault((min(k, peer), max(k, peer)), set()).add(gen)
            elif rtype == NVML_NVLINK_DEVICE_TYPE_IBMNPU:
                continue  # a CPU link (POWER9), not a GPU path
            else:
                log.info(
                    "discovery.nvlink.peer_unresolved",
                    gpu=f.uuid,
                    link=link,
                    remote_bus_id=remote,
                    remote_type=rtype,
                    hint="peer GPU not visible or excluded; link ignored",
                )

    links: list[list[Link | None]] = [[None] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            link = _direct_link(facts, i, j, direct, direct_gens)
            if link is None and switch[i] and switch[j] and _p2p_nvlink_ok(backend, facts[i], facts[j]):
                gen = _pair_generation(switch_gens[i] | switch_gens[j], facts[i], facts[j])
                link = Link(LinkKind.NVSWITCH, min(switch[i], switch[j]), gen)
            if link is None:
                level = _try(backend.topology_common_ancestor, facts[i].nvml_index, facts[j].nvml_index)
                if level is None:
                    log.warning("discovery.pcie.ancestor_unknown", gpu_a=facts[i].uuid, gpu_b=facts[j].uuid,
                                assumed="SYS")
                link = Link(_pcie_kind(level))
            links[i][j] = links[j][i] = link
    return links


def _direct_link(
    facts: list[_GpuFacts],
    i: int,
    j: int,
    direct: list[list[int]],
    gens: dict[tuple[int, int], set[int | None]],
) -> Link | None:
    a, b = direct[i][j], direct[j][i]
    if not a and not b:
        return None
    if a != b:
        # Each side counts its own active links; a link seen from one side only is not reliable in both directions.
        log.warning("discovery.nvlink.lanes_asymmetric", gpu_a=facts[i].uuid, gpu_b=facts[j].uuid, lanes_a=a, lanes_b=b)
    lanes = min(x for x in (a, b) if x)
    return Link(LinkKind.NVLINK, lanes, _pair_generation(gens.get((i, j), set()), facts[i], facts[j]))


def _pair_generation(gens: set[int | None], a: _GpuFacts, b: _GpuFacts) -> int:
    """The slowest generation among the links involved; the model name when NVML did not say; 1 as a last floor."""
    known = {g for g in gens if g is not None}
    if known:
        return min(known)
    by_model = [
        g
        for g in (
            bandwidth.nvlink_generation_for_model(a.name),
            bandwidth.nvlink_generation_for_model(b.name),
        )
        if g is not None
    ]
    if by_model:
        return min(by_model)
    log.warning("discovery.nvlink.generation_unknown", gpu_a=a.uuid, gpu_b=b.uuid, assumed=1)
    return 1


def _p2p_nvlink_ok(backend: NvmlBackend, a: _GpuFacts, b: _GpuFacts) -> bool:
    for x, y in ((a, b), (b, a)):
        status = _try(backend.p2p_status, x.nvml_index, y.nvml_index, NVML_P2P_CAPS_INDEX_NVLINK)
        if status is not None and status != NVML_P2P_STATUS_OK:
            log.info(
                "discovery.nvswitch.p2p_denied",
                gpu_a=x.uuid,
                gpu_b=y.uuid,
                p2p_status=status,
                hint="both GPUs have switch links but NVML says no NVLink P2P between them (fabric partition?)",
            )
            return False
    return True


def _pcie_generation(facts: list[_GpuFacts], links: list[list[Link | None]]) -> int:
    """The slowest GPU's maximum link generation, clamped to the generations the bandwidth table knows."""
    known = [f.pcie_max_gen for f in facts if f.pcie_max_gen]
    if known:
        gen = min(known)
        table = sorted(bandwidth.PCIE_X16_GBPS)
        return min(max(gen, table[0]), table[-1])
    nv = [lk.generation for row in links for lk in row if lk is not None and lk.generation is not None]
    if nv:
        return bandwidth.PCIE_GENERATION_FOR_NVLINK[max(nv)]
    return bandwidth.DEFAULT_PCIE_GENERATION


@dataclass(frozen=True)
class Neighbourhood:
    """Where GPUs sit: NUMA node and NVLink island by UUID (None: unknown, or no NVLink to another listed GPU), and
    each island's members. Read for MIG GPUs, which the topology leaves out, so placement can keep islands whole."""

    numa: dict[str, int | None]
    islands: dict[str, int | None]
    members: dict[int, tuple[str, ...]]


def neighbourhood(backend: NvmlBackend, gpus: Sequence[tuple[int, str]]) -> Neighbourhood:
    """NUMA nodes and NVLink islands of `gpus` ((NVML index, UUID), MIG-enabled or not) from the parent GPUs'
    NVLink answers: GPUs joined by a direct link share an island, as do all GPUs with an active NVSwitch link.

    NVML answers the NVLink queries on a MIG-enabled GPU as on any GPU (they describe the physical links; MIG only
    removes peer-to-peer over them), so a MIG GPU's island is that of its board; P2P status is not asked, since a
    MIG GPU has none to give. Islands are numbered by their lowest NVML index; a GPU alone has island None."""
    facts = [_gpu_facts(backend, i, uuid, normalize_bus_id(b) if (b := _try(backend.pci_bus_id, i)) else None)
             for i, uuid in gpus]
    parent = list(range(len(facts)))

    def root(k: int) -> int:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    by_bus = {f.bus: k for k, f in enumerate(facts) if f.bus}
    switched = []
    for k, f in enumerate(facts):
        for _link, _gen, remote, rtype in f.links:
            if rtype == NVML_NVLINK_DEVICE_TYPE_SWITCH or remote == NVSWITCH_REMOTE_BUS_ID:
                switched.append(k)
            elif remote in by_bus and rtype in (None, NVML_NVLINK_DEVICE_TYPE_GPU):
                parent[root(k)] = root(by_bus[remote])
    for k in switched[1:]:
        parent[root(k)] = root(switched[0])
    groups: dict[int, list[int]] = {}
    for k in sorted(range(len(facts)), key=lambda k: facts[k].nvml_index):
        groups.setdefault(root(k), []).append(k)
    islands: dict[str, int | None] = {f.uuid: None for f in facts}
    members: dict[int, tuple[str, ...]] = {}
    for n, ks in enumerate(g for g in groups.values() if len(g) > 1):
        members[n] = tuple(facts[k].uuid for k in ks)
        islands.update({facts[k].uuid: n for k in ks})
    return Neighbourhood({f.uuid: f.numa for f in facts}, islands, members)
