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

from gputopo.contract import MIG_STRATEGY_NONE, mig_none_reason
from gputopo.core.codec import MIG_STRATEGIES, Mig, MigGpuInfo, MigInstance
from gputopo.discovery.nvml_mig import MigGpu

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class MigAdvertised:
    """What the plugin advertises of its MIG GPUs: NVIDIA's strategy, and the resource each advertised MIG UUID is
    registered under (`nvidia.com/mig-1g.18gb` under mixed, the configured resource under single; absent: not
    advertised). By GPU UUID, where known: `numa` the GPU's NUMA node, `islands` its NVLink island, `peers` the
    other GPUs of that island (whole GPUs by advertised id, MIG GPUs by UUID), so the extender sees an island in
    use when a whole GPU of it is held."""

    strategy: str
    resources: Mapping[str, str] = field(default_factory=dict)
    numa: Mapping[str, int | None] = field(default_factory=dict)
    islands: Mapping[str, int | None] = field(default_factory=dict)
    peers: Mapping[str, Sequence[str]] = field(default_factory=dict)

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
    held = {i for ids in in_use.values() for i in ids}
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
    reason = mig_none_reason(len(out)) if advertised.strategy == MIG_STRATEGY_NONE else None
    return Mig(advertised.strategy, reason, tuple(out))
