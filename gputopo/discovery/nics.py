"""A real node's NICs from sysfs: which GPUs reach which NIC through their own PCIe switch, for GPUDirect RDMA.

NVML does not list NICs, so they are read from the PCI tree the kernel exposes (not namespaced, so a pod sees the
host's devices): every network-class PCI function under /sys/bus/pci/devices, less SR-IOV virtual functions.
- RDMA: the function has an `infiniband/<dev>` directory (an InfiniBand or RoCE verbs device); its name is the
  verbs name (mlx5_0, as `nvidia-smi topo -m` prints it) and its rate the fastest ACTIVE port's `rate`
  ("400 Gb/sec (4X NDR)"). An RDMA device with no active port carries nothing and is left out.
- Plain Ethernet: named by its `net/<ifname>`, rate from `speed` (Mb/s) when the link is up. Inside a pod's network
  namespace the host's interfaces are not visible there: name and rate are then unknown (BDF as name, rate None).
- PCIe path class to each GPU from the two devices' bridge chains, the way `nvidia-smi topo -m` classes them:
  different host bridges NODE (same NUMA node) or SYS; no common bridge PHB; a common switch with at most one
  bridge below it on each side PIX; deeper PXB. A GPU whose bus id is not in sysfs is SYS to every NIC.
Every read is bounded; an unreadable file makes that fact unknown, never the whole discovery fail.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from gputopo.core.topology import MAX_NIC_GBIT, LinkKind, Nic, Topology

log = structlog.get_logger(__name__)

SYSFS = Path("/sys")
MAX_PCI_DEVICES = 4096
MAX_NICS = 256
_MAX_READ = 4096
_BDF_RE = re.compile(r"^[0-9a-f]{4,8}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_ROOT_RE = re.compile(r"^pci[0-9a-f]{4,8}:[0-9a-f]{2}$")
_RATE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec")
_NETWORK_CLASS = 0x02


@dataclass(frozen=True, slots=True)
class PciDevice:
    """A PCI function's place in the tree: its host bridge (pciDDDD:BB), the bridges above it, its NUMA node."""

    bdf: str
    root: str
    bridges: tuple[str, ...]
    numa: int | None


def sysfs_bdf(bus_id: str) -> str:
    """NVML's "00000000:3B:00.0" (or any domain width and case, or no domain) as sysfs names it: "0000:3b:00.0"."""
    text = bus_id.strip().lower()
    parts = text.split(":")
    if len(parts) == 2:
        return f"0000:{text}"
    if len(parts) == 3:
        try:
            return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}"
        except ValueError:
            return text
    return text


def pci_class(a: PciDevice | None, b: PciDevice) -> LinkKind:
    """The PCIe path class between two devices, as `nvidia-smi topo -m` prints it."""
    if a is None:
        return LinkKind.SYS
    if a.root != b.root:
        return LinkKind.NODE if a.numa is not None and a.numa == b.numa else LinkKind.SYS
    common = 0
    for x, y in zip(a.bridges, b.bridges, strict=False):
        if x != y:
            break
        common += 1
    if common == 0:
        return LinkKind.PHB
    below = max(len(a.bridges) - common, len(b.bridges) - common)
    return LinkKind.PIX if below <= 1 else LinkKind.PXB


def discover_nics(gpu_bus_ids: Sequence[str | None], sysfs: Path = SYSFS) -> tuple[Nic, ...]:
    """Every usable NIC with its path class to each GPU (in `gpu_bus_ids` order); () when sysfs has no PCI bus."""
    devices_dir = sysfs / "bus" / "pci" / "devices"
    try:
        names = sorted(os.listdir(devices_dir))[:MAX_PCI_DEVICES]
    except OSError:
        return ()
    gpus = [_device(devices_dir, sysfs_bdf(b)) if b else None for b in gpu_bus_ids]
    nics: list[Nic] = []
    for bdf in names:
        if len(nics) >= MAX_NICS:
            break
        if not _BDF_RE.match(bdf):
            continue
        entry = devices_dir / bdf
        cls = _read_int(entry / "class", 16)
        if cls is None or cls >> 16 != _NETWORK_CLASS or (entry / "physfn").exists():
            continue
        device = _device(devices_dir, bdf)
        if device is None:
            continue
        nic = _nic(entry, device, gpus)
        if nic is not None:
            nics.append(nic)
    return tuple(nics)


def attach_nics(topo: Topology, sysfs: Path = SYSFS) -> Topology:
    """The topology with the node's NICs from sysfs (unchanged when sysfs shows none)."""
    nics = discover_nics([g.pci_bus_id for g in topo.gpus], sysfs)
    if not nics:
        log.info("discovery.nics.none", sysfs=str(sysfs))
        return topo
    log.info(
        "discovery.nics.found",
        nics=[f"{n.name} rdma={n.rdma} {n.link_gbit or '?'}Gb/s" for n in nics],
        gpudirect_gpus=sum(1 for i in range(topo.size) if any(n.rdma and n.gpu_links[i].value in ("PIX", "PXB")
                                                               for n in nics)),
    )
    return Topology.build(topo.gpus, topo.links, nics, topo.pcie_generation, topo.socket_link_gbps)


def _nic(entry: Path, device: PciDevice, gpus: Sequence[PciDevice | None]) -> Nic | None:
    links = tuple(pci_class(g, device) for g in gpus)
    verbs = _listdir(entry / "infiniband")
    if verbs:
        rates = [r for dev in verbs for r in _active_rates(entry / "infiniband" / dev)]
        if not rates:
            return None  # no active port: carries nothing
        return Nic(verbs[0], links, True, _rate(max(rates)))
    ifaces = _listdir(entry / "net")
    if not ifaces:
        return Nic(device.bdf, links, False, None)
    net = entry / "net" / ifaces[0]
    speed = _read_int(net / "speed", 10)
    up = _read(net / "operstate") == "up"
    return Nic(ifaces[0], links, False, _rate(speed / 1000.0) if up and speed and speed > 0 else None)


def _active_rates(verbs_dir: Path) -> list[float]:
    out = []
    for port in _listdir(verbs_dir / "ports"):
        state = _read(verbs_dir / "ports" / port / "state") or ""
        m = _RATE_RE.match(_read(verbs_dir / "ports" / port / "rate") or "")
        if "ACTIVE" in state.upper() and m:
            out.append(float(m.group(1)))
    return out


def _rate(gbit: float) -> float | None:
    return gbit if 0 < gbit <= MAX_NIC_GBIT else None


def _device(devices_dir: Path, bdf: str) -> PciDevice | None:
    """Where the function sits: the components of its resolved path under /sys/devices."""
    try:
        real = Path(os.path.realpath(devices_dir / bdf))
    except (OSError, ValueError):
        return None
    parts = real.parts
    roots = [i for i, p in enumerate(parts) if _ROOT_RE.match(p)]
    if not roots or parts[-1] != bdf:
        return None
    chain = parts[roots[-1] + 1 : -1]
    if not all(_BDF_RE.match(p) for p in chain):
        return None
    numa = _read_int(real / "numa_node", 10)
    return PciDevice(bdf, parts[roots[-1]], tuple(chain), numa if numa is not None and numa >= 0 else None)


def _read(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(_MAX_READ).decode("ascii", "replace").strip()
    except OSError:
        return None


def _read_int(path: Path, base: int) -> int | None:
    text = _read(path)
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


def _listdir(path: Path) -> list[str]:
    try:
        return sorted(os.listdir(path))[:64]
    except OSError:
        return []
