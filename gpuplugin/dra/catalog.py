"""Which devices a node offers through DRA, and what each device is: pure, derived from the topology alone.

Every GPU is offered alone twice, once in each of two published groups with their own order, because the two
consumers of single GPUs want different orders (gpuplugin.dra.ordering):
- `gpu-3` (group "gpu", attribute order=rings): the first N free form good rings, for `nvidia.com/gpu: N` through
  the DRAExtendedResource class and the `any-N` fallback of the "best N" templates;
- `one-3` (group "one", attribute order=one): the order successive 1-GPU claims should take them, which keeps the
  best blocks whole for the multi-GPU claims that follow.
Both consume the GPU's one counter, so a GPU is never handed out through both. GPU sets of the configured sizes are
devices too (`set-0-1-2-3`, group "set-4"), each consuming one shared counter per member GPU so that the scheduler's
allocator never hands a GPU out twice.

Two more groups come from gpuplugin.dra.partitions and are passed in whole: "shared" (a GPU the sharing config
shares, one multi-allocatable device with a capacity; such a GPU is `exclude`d from the whole-GPU devices, so it is
never offered both ways) and "mig" (one device per existing MIG instance of a MIG-enabled GPU, which is not in the
topology at all). Neither consumes counters: the scheduler accounts a shared GPU by its capacity, and a MIG instance
is a device of its own.

**The trap this module is built around:** the allocator recomputes the counters an allocated device uses from the
device as currently published. A device that disappears, or whose counter list changes, while a claim holds it
gives its GPUs away a second time. So a device's name and counters are a pure function of its member GPUs (the
name spells the members), and which devices exist depends only on the topology and the options, never on what is
allocated, healthy or free: republishing can reorder and taint devices, never rename, drop or re-wire one.

When every subset of a size does not fit in `max_devices`, the best ones by the static score are offered with each
GPU's share capped (gputopo.core.ranking.SetRanker.select), and `Catalog.offered` says how many of how many.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gputopo.contract import DRA_ONE, DRA_RINGS, parse_dra_device
from gputopo.core.ranking import GpuSet, SetRanker
from gputopo.core.topology import Topology

COUNTER_SET = "gpus"
MAX_GPUS = 32  # one counter set holds at most 32 counters, and a claim at most 32 devices
MAX_SET_SIZE = 16  # set names and `members` values stay inside their 63/64-character limits up to 32 GPUs
DEFAULT_SET_SIZES = (2, 4, 8, 16)
DEFAULT_MAX_DEVICES = 512
STANDARD_DOMAIN = "resource.kubernetes.io"
RINGS = DRA_RINGS  # group (and name prefix) of the singles whose first N free form good rings
ONE = DRA_ONE  # group (and name prefix) of the singles in the order successive 1-GPU claims take them
SINGLE_GROUPS = (RINGS, ONE)
SHARED = "shared"  # group (and name prefix) of shared GPUs (gpuplugin.dra.partitions)
MIG = "mig"  # group (and name prefix) of MIG instances (gpuplugin.dra.partitions)
STATIC_GROUPS = (SHARED, MIG)  # published in catalog order whatever the state


class CatalogError(ValueError):
    """The topology or the options cannot be offered as DRA devices; the message says which limit and why."""


def device_name(gpus: Sequence[int], single: str = RINGS) -> str:
    """The one name of the device made of exactly these GPUs (for one GPU: the one in group `single`)."""
    members = sorted(gpus)
    if len(members) == 1:
        if single not in SINGLE_GROUPS:
            raise ValueError(f"single-GPU group must be one of {SINGLE_GROUPS}, got {single!r}")
        return f"{single}-{members[0]}"
    return "set-" + "-".join(map(str, members))


def set_group(size: int) -> str:
    """The group (devices published together, best first) of the sets of `size` GPUs."""
    return f"set-{size}"


def parse_device_name(name: str) -> GpuSet | None:
    """The GPU indices a device name spells, or None when it is not one of ours (gputopo.contract)."""
    parsed = parse_dra_device(name)
    return parsed[1] if parsed is not None else None


def counter_name(gpu: int) -> str:
    return f"gpu{gpu}"


@dataclass(frozen=True)
class Device:
    """One offered device: its GPUs (topology indices), the group it is published in, static score parts and
    attributes."""

    name: str
    gpus: GpuSet
    group: str  # RINGS, ONE or set_group(size)
    ring_gbps: float
    total_gbps: float
    numa_nodes: int
    nvlink_island: bool
    attributes: Mapping[str, Any] = field(default_factory=dict, compare=False)
    # shared and MIG devices only (gpuplugin.dra.partitions):
    capacity: Mapping[str, Any] = field(default_factory=dict, compare=False)
    multi: bool = False  # allowMultipleAllocations
    uuid: str = ""  # the GPU's (shared) or the MIG instance's UUID
    replicas: int = 0  # shares of a shared GPU
    share_mib: int | None = None  # GPU memory per share (None: the GPU's memory is unknown)
    strategy: str = ""  # "time-slicing" | "mps" for a shared GPU
    device_nodes: tuple[str, ...] = ()  # a MIG instance's: the parent's /dev/nvidiaN and its capability nodes

    @property
    def size(self) -> int:
        return len(self.gpus)

    @property
    def kind(self) -> str:
        """"gpus" for whole GPUs and sets, else the group ("shared", "mig")."""
        return self.group if self.group in STATIC_GROUPS else "gpus"


@dataclass(frozen=True)
class Offered:
    """How many sets of one size are offered out of how many exist."""

    size: int
    offered: int
    possible: int

    @property
    def complete(self) -> bool:
        return self.offered == self.possible


class Catalog:
    """The devices of one node. `groups` lists device names per group (RINGS, ONE, then sets by size), each in
    static order."""

    def __init__(self, topology: Topology, devices: Sequence[Device], offered: Sequence[Offered],
                 whole: Iterable[int] | None = None) -> None:
        self.topology = topology
        self.whole = frozenset(range(topology.size) if whole is None else whole)  # GPUs offered whole
        self.ranker = SetRanker(topology)
        self.devices: dict[str, Device] = {d.name: d for d in devices}
        self.offered = tuple(offered)
        self.groups: dict[str, list[str]] = {}
        for d in devices:
            self.groups.setdefault(d.group, []).append(d.name)

    @classmethod
    def build(
        cls,
        topology: Topology,
        set_sizes: Iterable[int] = DEFAULT_SET_SIZES,
        max_devices: int = DEFAULT_MAX_DEVICES,
        keep: Iterable[str] = (),
        exclude: Iterable[int] = (),
        extra: Sequence[Device] = (),
    ) -> Catalog:
        """Every GPU alone (in both single groups), plus sets of each size in `set_sizes` that is 2..min(16, GPUs),
        within `max_devices` in total. `keep` names devices that must be offered whatever the budget (ones a claim
        still holds). GPUs in `exclude` (shared ones) are in no such device; `extra` (shared and MIG devices) is
        appended as it is."""
        n = topology.size
        excluded = set(exclude)
        whole = [g for g in range(n) if g not in excluded]
        if n > MAX_GPUS:
            raise CatalogError(
                f"{n} GPUs: a DRA pool of counter-consuming devices offers at most {MAX_GPUS} GPUs per node "
                "(one shared counter set holds 32 counters; a claim holds at most 32 devices)"
            )
        sizes = sorted({s for s in set_sizes if 2 <= s <= min(len(whole), MAX_SET_SIZE)})
        bad = [s for s in set_sizes if s < 2 or s > MAX_SET_SIZE]
        if bad:
            raise CatalogError(f"set sizes must be within 2..{MAX_SET_SIZE}, got {bad}")
        room = max_devices - len(SINGLE_GROUPS) * len(whole) - len(extra)
        if room < 0:
            raise CatalogError(f"max devices {max_devices} is fewer than the node's {len(SINGLE_GROUPS) * len(whole)} "
                               f"single-GPU devices (every GPU is offered in {len(SINGLE_GROUPS)} groups) plus "
                               f"{len(extra)} shared and MIG devices")
        ranker = SetRanker(topology)
        limits = _share(room, {s: math.comb(len(whole), s) for s in sizes})
        chosen: dict[int, list[GpuSet]] = {1: [(g,) for g in whole]}
        for s in sizes:
            # with GPUs left out, ask for more and drop those holding one (fewer may remain: `offered` says so)
            asked = limits[s] if not excluded else min(math.comb(n, s), 8 * limits[s] + 64)
            chosen[s] = [m for m in ranker.select(s, asked) if excluded.isdisjoint(m)][: limits[s]]
        extra_names = {d.name for d in extra}
        for name in keep:
            if name in extra_names or name.startswith((f"{SHARED}-", f"{MIG}-")):
                continue  # not budgeted; one that is gone is the driver's to report (Driver._check_loaded)
            members = parse_device_name(name)
            if members is None or not members or max(members) >= n:
                raise CatalogError(f"held device {name!r} is not a device of this {n}-GPU node")
            if not excluded.isdisjoint(members):
                raise CatalogError(f"held device {name!r} holds GPUs {sorted(excluded & set(members))} that are to "
                                   "be shared: keep them whole until the claim ends (gpuplugin.dra.partitions)")
            if members not in chosen.setdefault(len(members), []):
                chosen[len(members)].append(members)
        islands = {g: tuple(isl) for isl in topology.nvlink_islands() for g in isl}
        devices = []
        offered = [Offered(1, len(whole), len(whole))]
        for s in sorted(chosen):
            ordered = sorted(chosen[s], key=lambda m: (tuple(-x for x in ranker.static_key(m)), m))
            for group in SINGLE_GROUPS if s == 1 else (set_group(s),):
                devices += [_device(topology, ranker, m, islands, group) for m in ordered]
            if s > 1:
                offered.append(Offered(s, len(ordered), math.comb(len(whole), s)))
        names = {d.name for d in devices}
        clash = sorted(names & extra_names)
        if clash or len(extra_names) != len(extra):
            raise CatalogError(f"shared and MIG device names clash: {clash[:4]}")
        return cls(topology, [*devices, *extra], offered, whole)

    def gpus_of(self, names: Iterable[str]) -> set[int]:
        return {g for name in names for g in self.devices[name].gpus}

    def summary(self) -> str:
        """One line for logs and the `slices` command, e.g. `115 devices: 2 x 8 single GPUs, all 28 sets of 2`."""
        parts = []
        for o in self.offered:
            what = "single GPUs" if o.size == 1 else f"sets of {o.size}"
            parts.append(f"{len(SINGLE_GROUPS)} x {o.possible} {what}" if o.size == 1 else
                         f"all {o.possible} {what}" if o.complete else f"{o.offered} of {o.possible} {what}")
        parts += [f"{len(self.groups[g])} {g}" for g in STATIC_GROUPS if self.groups.get(g)]
        return f"{len(self.devices)} devices: " + ", ".join(parts)


def _share(room: int, wanted: Mapping[int, int]) -> dict[int, int]:
    """Split `room` device slots over sizes: sizes that need less than an equal share keep what they need, the
    rest is shared equally among the others (smaller sizes first get any remainder of the division)."""
    out: dict[int, int] = {}
    left = dict(wanted)
    while left:
        share = room // len(left)
        small = {s: w for s, w in left.items() if w <= share}
        if not small:
            for i, s in enumerate(sorted(left)):
                out[s] = share + (1 if i < room % len(left) else 0)
            return out
        for s, w in small.items():
            out[s] = w
            room -= w
            del left[s]
    return out


def _device(topology: Topology, ranker: SetRanker, members: GpuSet, islands: Mapping[int, tuple[int, ...]],
            group: str) -> Device:
    ring, total, neg_numa = ranker.static_key(members)
    island = islands[members[0]]
    on_island = len(island) > 1 and set(members) <= set(island)
    attributes: dict[str, Any] = {
        "size": {"int": len(members)},
        "members": {"string": ",".join(map(str, members))},
        "allreduceGBps": {"int": ring // 1000},
        "nvlinkIsland": {"bool": on_island},
        "numaNodes": {"int": -neg_numa},
    }
    if len(members) == 1:
        # what tells the two single-GPU groups apart in a DeviceClass's CEL (deploy/dra/deviceclasses.yaml)
        attributes["order"] = {"string": "rings" if group == RINGS else "one"}
        gpu = topology.gpus[members[0]]
        attributes["uuid"] = {"string": gpu.id[:64]}
        if gpu.model:
            attributes["model"] = {"string": gpu.model[:64]}
        bus = standard_pci_bus_id(gpu.pci_bus_id)
        if bus:
            attributes[f"{STANDARD_DOMAIN}/pciBusID"] = {"string": bus}
    return Device(
        name=device_name(members, group),
        gpus=members,
        group=group,
        ring_gbps=ring / 1000,
        total_gbps=total / 1000,
        numa_nodes=-neg_numa,
        nvlink_island=on_island,
        attributes=attributes,
    )


_BUS_RE = re.compile(r"^([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


def standard_pci_bus_id(bus: str | None) -> str | None:
    """NVML's `00000000:07:00.0` as the standard attribute wants it (`dddd:bb:dd.f`, lowercase), or None."""
    if not bus:
        return None
    m = _BUS_RE.match(bus.strip())
    if m is None:
        return None
    domain = int(m.group(1), 16)
    if domain > 0xFFFF:
        return None
    return f"{domain:04x}:{m.group(2).lower()}:{m.group(3).lower()}.{m.group(4)}"
