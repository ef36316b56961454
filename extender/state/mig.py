"""A node's MIG instances as placement reads them (issue 23; the node state's "mig" member, gputopo.core.codec.Mig).

The plugin publishes each instance with the resource it is advertised as and whether a pod holds it; plans name
MIG UUIDs, so what is in flight is a set of UUIDs (extender.state.reservations, `Reservation.instances`), taken
out of the free ones until the node's state shows them held. A MIG GPU is never offered whole: it is not in the
topology the plugin publishes, and its instances only ever go to pods asking for their resource.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from gputopo.core.codec import Mig, MigGpuInfo


@dataclass(frozen=True, slots=True)
class NodeMig:
    """The node's MIG GPUs; `names` the resource names its instances are advertised as."""

    mig: Mig
    names: frozenset[str]
    used: frozenset[str]  # MIG UUIDs pods hold, as published

    @property
    def strategy(self) -> str:
        return self.mig.strategy

    @property
    def gpus(self) -> tuple[MigGpuInfo, ...]:
        return self.mig.gpus

    def serves(self, resource: str) -> bool:
        return resource in self.names

    def profile_of(self, resource: str) -> str | None:
        """The device name the resource's instances have (the codec checks there is one per resource)."""
        return next((i.profile for g in self.mig.gpus for i in g.instances if i.resource == resource), None)

    @property
    def models(self) -> frozenset[str]:
        return frozenset(g.model for g in self.mig.gpus if g.model)


def node_mig(mig: Mig) -> NodeMig:
    names = frozenset(i.resource for g in mig.gpus for i in g.instances if i.resource is not None)
    return NodeMig(mig, names, mig.used_ids)


def with_held(view: NodeMig, uuids: Iterable[str], held: bool) -> NodeMig:
    """The view with `uuids` marked held (or free): standalone mode's bind and release."""
    ids = frozenset(uuids)
    gpus = tuple(replace(g, instances=tuple(replace(i, used=held) if i.uuid in ids else i for i in g.instances))
                 for g in view.mig.gpus)
    return node_mig(replace(view.mig, gpus=gpus))
