"""Which GPU of this node is served how: whole under the plugin's resource, or as replicas of a shared resource.

A pure function of a SharingConfig and the node's GPUs, so the reload loop can compare the layout a file asks for
with the one it serves, and tests can check NVIDIA's examples without a kubelet. Errors name the config field.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from gpuplugin.sharing.config import SHARED_SUFFIX, SharingConfig, SharingConfigError
from gpuplugin.sharing.mig_strategy import MigInstance
from gputopo.core.topology import Topology


@dataclass(frozen=True)
class SharedSet:
    """One shared resource: its advertised name and the replicas of each of its GPUs (topology index order)."""

    name: str
    strategy: str  # "time-slicing" | "mps"
    fail_requests_greater_than_one: bool
    distinct_gpus: bool
    replicas: tuple[tuple[int, int], ...]  # (GPU index, replicas)

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(i for i, _ in self.replicas)


@dataclass(frozen=True)
class Layout:
    """GPUs served whole, and the shared sets. Every GPU of the node is in exactly one of them."""

    whole: tuple[int, ...]
    shared: tuple[SharedSet, ...] = ()

    @property
    def strategy(self) -> str | None:
        return self.shared[0].strategy if self.shared else None

    def role(self, index: int) -> tuple[str, int] | None:
        """(shared resource, replicas) of a GPU, or None when it is served whole."""
        for s in self.shared:
            for i, n in s.replicas:
                if i == index:
                    return s.name, n
        return None


def whole_layout(topology: Topology) -> Layout:
    return Layout(tuple(range(topology.size)))


def _gpu_index(ref: object, topology: Topology, where: str) -> int:
    if isinstance(ref, bool):
        raise SharingConfigError(f"{ref!r} is not a GPU index or UUID", where)
    if isinstance(ref, int) or (isinstance(ref, str) and ref.isdigit()):
        index = int(ref)
        if not 0 <= index < topology.size:
            raise SharingConfigError(f"GPU index {index} is not on this node ({topology.size} GPUs: "
                                     f"0-{topology.size - 1})", where)
        return index
    text = str(ref)
    if text.startswith("MIG-") or ":" in text:
        raise SharingConfigError(f"{text!r} is a MIG device; share it in an entry named after its MIG resource "
                                 "(nvidia.com/mig-<profile>, as NVIDIA's config does)", where)
    for gpu in topology.gpus:
        if gpu.id == text:
            return gpu.index
    raise SharingConfigError(f"no GPU {text[:80]!r} on this node", where)


@dataclass(frozen=True)
class MigView:
    """What MIG serves on the node (gpuplugin.sharing.mig_node): resource -> MIG UUIDs, and the MIG-enabled GPUs."""

    resources: Mapping[str, frozenset[str]] = field(default_factory=dict)
    gpus: frozenset[str] = frozenset()

    @property
    def uuids(self) -> frozenset[str]:
        return frozenset(u for ids in self.resources.values() for u in ids)


def is_mig_resource(name: str, mig: MigView, whole_resource: str) -> bool:
    """A resource MIG devices are served as (`nvidia.com/mig-<profile>`, or whatever the MIG node serves)."""
    domain = whole_resource.split("/", 1)[0] if "/" in whole_resource else "nvidia.com"
    return name in mig.resources or name.startswith(f"{domain}/mig-")


@dataclass(frozen=True)
class MigShare:
    """Time-slicing of one MIG resource's instances: replicas per MIG UUID, and the config's request rules."""

    replicas: Mapping[str, int]
    fail_requests_greater_than_one: bool
    distinct: bool


@dataclass(frozen=True)
class MigSharing:
    """MIG resources after time-slicing: resource -> instances, and the shares of the replicated ones."""

    resources: Mapping[str, tuple[MigInstance, ...]]
    shares: Mapping[str, MigShare] = field(default_factory=dict)


def share_mig(config: SharingConfig | None, resources: Mapping[str, tuple[MigInstance, ...]],
              whole_resource: str) -> MigSharing:
    """Time-slicing on MIG instances, as NVIDIA offers it: a `timeSlicing` entry naming a MIG resource served here
    (`nvidia.com/mig-1g.10gb`; `nvidia.com/gpu` under the single strategy) shares its instances, all, the first N
    (MIG UUID order) or those `devices` names by MIG UUID, advertised as `rename` (or `<name>.shared`). Entries
    naming whole GPUs are the SharingNode's. Raises SharingConfigError naming the field."""
    if config is None or config.strategy != "time-slicing" or config.section is None:
        return MigSharing(dict(resources))
    section = config.section
    out = {name: list(insts) for name, insts in resources.items()}
    shares: dict[str, MigShare] = {}
    taken: dict[str, int] = {}
    for n, entry in enumerate(section.resources):
        where = f"sharing.timeSlicing.resources[{n}]"
        if entry.name not in resources:
            if is_mig_resource(entry.name, MigView(), whole_resource):
                raise SharingConfigError(f"{entry.name} is not served on this node (MIG resources here: "
                                         f"{sorted(resources) or 'none'})", f"{where}.name")
            continue
        pool = {i.uuid: i for i in resources[entry.name]}
        if entry.devices == "all":
            chosen = sorted(pool)
        elif isinstance(entry.devices, int):
            if entry.devices > len(pool):
                raise SharingConfigError(f"asks for {entry.devices} MIG devices; {entry.name} has {len(pool)}",
                                         f"{where}.devices")
            chosen = sorted(pool)[: entry.devices]
        else:
            chosen = []
            for k, ref in enumerate(entry.devices):
                if str(ref) not in pool:
                    raise SharingConfigError(f"{str(ref)[:80]!r} is not a MIG device of {entry.name} on this node "
                                             "(name MIG devices by MIG UUID)", f"{where}.devices[{k}]")
                chosen.append(str(ref))
        for uuid in chosen:
            if uuid in taken:
                raise SharingConfigError(f"MIG device {uuid} is already shared by resources[{taken[uuid]}]",
                                         f"{where}.devices")
            taken[uuid] = n
        advertised = entry.rename or (entry.name + SHARED_SUFFIX if section.rename_by_default else entry.name)
        out[entry.name] = [i for i in out[entry.name] if i.uuid not in set(chosen)]
        if advertised != entry.name and advertised in resources:
            raise SharingConfigError(f"rename clash: {advertised} is already served", f"{where}.rename")
        if advertised == entry.name and out[entry.name]:
            raise SharingConfigError(f"rename clash: replicas would be advertised as {entry.name}, the name of "
                                     f"{len(out[entry.name])} MIG devices left unshared; set rename or "
                                     "renameByDefault, or share every one", f"{where}.rename")
        out.setdefault(advertised, []).extend(pool[u] for u in chosen)
        share = shares.get(advertised)
        replicas = {**(share.replicas if share else {}), **dict.fromkeys(chosen, entry.replicas)}
        shares[advertised] = MigShare(replicas, config.fail_requests_greater_than_one, section.distinct_gpus)
    return MigSharing({name: tuple(sorted(insts, key=lambda i: i.uuid)) for name, insts in sorted(out.items())
                       if insts}, shares)


def check_mps_on_mig(config: SharingConfig, mig: MigView, whole_resource: str) -> None:
    """SharingConfigError when an MPS config would run MPS on a MIG GPU: NVIDIA's plugin refuses MIG and MPS on one
    GPU too (its MPS daemon serves whole GPUs). Checked at config time, so the file is refused, not a pod."""
    if config.strategy != "mps" or config.section is None:
        return
    domain = whole_resource.split("/", 1)[0] if "/" in whole_resource else "nvidia.com"
    why = "MIG and MPS on one GPU are refused (NVIDIA's plugin refuses them too)"
    for n, entry in enumerate(config.section.resources):
        where = f"sharing.mps.resources[{n}]"
        if entry.name in mig.resources or entry.name.startswith(f"{domain}/mig-"):
            raise SharingConfigError(f"{entry.name} is served as MIG devices on this node; {why}", f"{where}.name")
        if isinstance(entry.devices, list):
            for k, ref in enumerate(entry.devices):
                if str(ref) in mig.gpus or str(ref) in mig.uuids or str(ref).startswith("MIG-"):
                    raise SharingConfigError(f"{str(ref)[:80]!r} is a MIG GPU or MIG device; {why}",
                                             f"{where}.devices[{k}]")


def resolve(config: SharingConfig, topology: Topology, whole_resource: str, mig: MigView | None = None) -> Layout:
    """The layout `config` asks for on a node of `topology` whose whole GPUs are `whole_resource`, beside the MIG
    devices `mig` serves (MPS is refused on those)."""
    if mig is not None:
        check_mps_on_mig(config, mig, whole_resource)
    section = config.section
    if config.strategy is None or section is None:
        return whole_layout(topology)
    base = "sharing.mps" if config.strategy == "mps" else "sharing.timeSlicing"
    owner: dict[int, int] = {}  # GPU index -> entry number
    per_name: dict[str, list[tuple[int, int]]] = {}
    for n, entry in enumerate(section.resources):
        where = f"{base}.resources[{n}]"
        if mig is not None and config.strategy == "time-slicing" and is_mig_resource(entry.name, mig,
                                                                                     whole_resource):
            continue  # replicas of MIG devices: the MIG node serves them (share_mig)
        if entry.name != whole_resource:
            raise SharingConfigError(f"only {whole_resource} (this plugin's resource) can be shared; "
                                     f"{entry.name!r} is not served here (MIG resources are not shared)",
                                     f"{where}.name")
        if entry.devices == "all":
            indices = list(range(topology.size))
        elif isinstance(entry.devices, int):
            if entry.devices > topology.size:
                raise SharingConfigError(f"asks for {entry.devices} GPUs; this node has {topology.size}",
                                         f"{where}.devices")
            indices = list(range(entry.devices))
        else:
            indices = []
            for k, ref in enumerate(entry.devices):
                index = _gpu_index(ref, topology, f"{where}.devices[{k}]")
                if index in indices:
                    raise SharingConfigError(f"GPU {index} is listed twice", f"{where}.devices[{k}]")
                indices.append(index)
        for index in indices:
            if index in owner:
                raise SharingConfigError(f"GPU {index} is already shared by resources[{owner[index]}]; a GPU "
                                         "belongs to one entry", f"{where}.devices")
            owner[index] = n
        advertised = entry.rename or (entry.name + SHARED_SUFFIX if section.rename_by_default else entry.name)
        per_name.setdefault(advertised, []).extend((i, entry.replicas) for i in indices)
    whole = tuple(i for i in range(topology.size) if i not in owner)
    if whole and whole_resource in per_name:
        n = next(k for k, e in enumerate(section.resources)
                 if (e.rename or (e.name + SHARED_SUFFIX if section.rename_by_default else e.name)) == whole_resource)
        raise SharingConfigError(
            f"rename clash: replicas would be advertised as {whole_resource}, the name of the {len(whole)} GPUs "
            f"left whole ({', '.join(map(str, whole))}); set rename or renameByDefault, or share every GPU",
            f"{base}.resources[{n}].rename")
    fail = config.fail_requests_greater_than_one
    shared = tuple(
        SharedSet(name, config.strategy, fail, section.distinct_gpus, tuple(sorted(entries)))
        for name, entries in sorted(per_name.items())
    )
    return Layout(whole, shared)


def advertised_counts(layout: Layout, whole_resource: str) -> dict[str, int]:
    """Devices per resource name, as the node's capacity shows them (NVIDIA: 8 GPUs x replicas 10 -> 80)."""
    counts = {s.name: sum(n for _, n in s.replicas) for s in layout.shared}
    if layout.whole:
        counts[whole_resource] = len(layout.whole)
    return counts


def describe(layout: Layout) -> Sequence[str]:
    return [f"{s.name}: {s.strategy} GPUs {list(s.gpus)} x {sorted({n for _, n in s.replicas})}"
            for s in layout.shared]
