"""The state's "mig" member (gputopo.core.codec.Mig) from what the plugin knows: NVML's MIG GPUs and devices
(NodeDiscovery.mig), what the plugin advertises of them (the strategy and a resource per MIG UUID, decided by the
deviceplugin's MIG registrations), and which MIG UUIDs pods hold (the kubelet's PodResources, read on every poll).

Why from these three and not from memory: "used" must come from the kubelet (a restart rebuilds it), and the
advertised set from the registrations themselves, so that the extender never plans an instance the kubelet does
not offer. Under strategy `none` the GPUs and instances are still listed (resource null) with the reason, so a
user asking why a MIG node takes no MIG pods reads it on the Node.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import structlog

from gputopo.contract import MIG_STRATEGY_NONE, REPLICA_SEPARATOR, mig_none_reason
from gputopo.core.codec import MAX_MIG_REASON, MIG_STRATEGIES, Mig, MigGpuInfo, MigInstance
from gputopo.discovery.nvml import Neighbourhood
from gputopo.discovery.nvml_mig import MigGpu

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class MigAdvertised:
    """What the plugin advertises of its MIG GPUs: NVIDIA's strategy, and the resource each advertised MIG UUID is
    registered under (`nvidia.com/mig-1g.18gb` under mixed, the configured resource under single; absent: not
    advertised). By GPU UUID, where known: `numa` the GPU's NUMA node, `islands` its NVLink island, `peers` the
    other GPUs of that island (whole GPUs by advertised id, MIG GPUs by UUID), so the extender sees an island in
    use when a whole GPU of it is held. `reason`: why MIG devices are left out under another strategy (a refused
    `single`, devices the strategy skips), for the Node; under `none` the contract's reason is written."""

    strategy: str
    resources: Mapping[str, str] = field(default_factory=dict)
    numa: Mapping[str, int | None] = field(default_factory=dict)
    islands: Mapping[str, int | None] = field(default_factory=dict)
    peers: Mapping[str, Sequence[str]] = field(default_factory=dict)
    reason: str | None = None

    def __post_init__(self) -> None:
        if self.strategy not in MIG_STRATEGIES:
            raise ValueError(f"MIG strategy {self.strategy!r} is not one of {', '.join(MIG_STRATEGIES)}")
        if self.strategy == MIG_STRATEGY_NONE and self.resources:
            raise ValueError("MIG strategy none advertises no MIG device")


def mig_block(gpus: Sequence[MigGpu], advertised: MigAdvertised, in_use: Mapping[str, Iterable[str]]) -> Mig | None:
    """The node's MIG state, or None when no GPU has MIG enabled. `in_use`: device ids held per resource
    (PodResourcesClient.in_use()). Devices NVML could not name or place are left out (logged): nothing could
    advertise them by a guessed name."""
    enabled = [g for g in gpus if g.enabled]
    if not enabled:
        return None
    held = {i.split(REPLICA_SEPARATOR, 1)[0] for ids in in_use.values() for i in ids}  # a replica holds its MIG UUID
    out: list[MigGpuInfo] = []
    for g in sorted(enabled, key=lambda g: g.nvml_index):
        instances = []
        for d in sorted(g.devices, key=lambda d: (d.placement.start if d.placement else 99, d.slot)):
            if d.name is None or d.placement is None:
                log.warning("plugin.publish.mig_device_skipped", gpu=g.uuid, device=d.uuid,
                            why="NVML gave no profile or placement")
                continue
            instances.append(MigInstance(d.name, d.placement.start, d.placement.size, d.uuid,
                                         advertised.resources.get(d.uuid), d.uuid in held))
        island = advertised.islands.get(g.uuid)
        peers = tuple(advertised.peers.get(g.uuid, ())) if island is not None else ()
        out.append(MigGpuInfo(g.uuid, g.nvml_index, advertised.numa.get(g.uuid), island, g.model, tuple(instances),
                              peers))
    reason = mig_none_reason(len(out)) if advertised.strategy == MIG_STRATEGY_NONE else advertised.reason
    if reason is not None and len(reason) > MAX_MIG_REASON:
        reason = reason[: MAX_MIG_REASON - 3] + "..."
    return Mig(advertised.strategy, reason, tuple(out))


def advertised_from(strategy: str, resources: Mapping[str, Iterable[str]], reason: str | None,
                    hood: Neighbourhood, whole_ids: Mapping[str, str]) -> MigAdvertised:
    """MigAdvertised from the MIG node's status (strategy, advertised MIG UUIDs per resource, its one-line reason)
    and discovery's neighbourhood of every GPU. `whole_ids`: whole GPU UUID -> the id it is advertised (and
    published in the topology) as; a MIG GPU's peers are the others of its island, whole GPUs by that id."""
    by_uuid = {u: name for name, uuids in resources.items() for u in uuids}
    peers = {g: tuple(whole_ids.get(p, p) for p in hood.members[n] if p != g)
             for g, n in hood.islands.items() if n is not None and g not in whole_ids}
    mig_gpus = [g for g in hood.islands if g not in whole_ids]
    return MigAdvertised(strategy, {} if strategy == MIG_STRATEGY_NONE else by_uuid,
                         {g: hood.numa.get(g) for g in mig_gpus}, {g: hood.islands.get(g) for g in mig_gpus}, peers,
                         reason)
