"""A node's shared GPUs as placement reads them: per shared resource name, which GPUs (as topology indices) carry
replicas, how many, and how many pods hold (issue 22; the node state's "sharing" member, gputopo.core.codec).

The plugin publishes counts, not which pod holds which replica, so what is in flight is counted too: a bind of a
shared plan reserves one replica on each planned GPU (extender.state.reservations, `Reservation.replicas`), with
the count of used replicas on that GPU that will show it held, and the reservation settles when the node's state
reaches that count on every GPU of the plan. Departures lower the counts waited for (pods left, so fewer are needed
to show this one), arrivals never do; a pod admitted in the same republish as another left keeps its replica
reserved until its pod ends, never the other way: the error is always a replica held too long, never one given
twice. Pods placed without this extender (its counts rise without a reservation behind them) can settle a
reservation early; they are outside what the extender can count.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gputopo.core.bitset import mask_of
from gputopo.core.codec import Sharing


@dataclass(frozen=True, slots=True)
class SharedGpus:
    """One shared resource of a node: GPU indices in the plugin's order, replicas and used replicas of each."""

    resource: str
    gpus: tuple[int, ...]
    replicas: tuple[int, ...]
    used: tuple[int, ...]

    @property
    def mask(self) -> int:
        return mask_of(self.gpus)


@dataclass(frozen=True, slots=True)
class NodeSharing:
    """How a node shares GPUs: one strategy, NVIDIA's failRequestsGreaterThanOne, its shared resources."""

    strategy: str
    one_per_pod: bool
    resources: tuple[SharedGpus, ...]
    mask: int  # every shared GPU: none is offered whole
    ids: tuple[tuple[str, int], ...]  # (gpu id, used replicas) of every shared GPU, what settles reservations

    def resource(self, name: str) -> SharedGpus | None:
        for r in self.resources:
            if r.resource == name:
                return r
        return None

    @property
    def names(self) -> frozenset[str]:
        return frozenset(r.resource for r in self.resources)

    def used_by_id(self) -> dict[str, int]:
        return dict(self.ids)


def node_sharing(sharing: Sharing, index: Mapping[str, int]) -> tuple[NodeSharing, list[str]]:
    """The placement view of a node's published sharing; GPU ids the topology does not know are dropped and
    returned, for the caller to report."""
    unknown: list[str] = []
    resources = []
    ids = []
    for r in sharing.resources:
        gpus, replicas, used = [], [], []
        for g in r.gpus:
            i = index.get(g.gpu)
            if i is None:
                unknown.append(g.gpu)
                continue
            gpus.append(i)
            replicas.append(g.replicas)
            used.append(g.used)
            ids.append((g.gpu, g.used))
        if gpus:
            resources.append(SharedGpus(r.name, tuple(gpus), tuple(replicas), tuple(used)))
    mask = 0
    for r in resources:
        mask |= r.mask
    return NodeSharing(sharing.strategy, sharing.fail_requests_greater_than_one, tuple(resources), mask,
                       tuple(ids)), unknown


def with_used(view: NodeSharing, ids_of: Mapping[int, str], delta: Mapping[int, int]) -> NodeSharing:
    """The view with `delta` replicas more (or fewer) used per GPU index: standalone mode's bind and release."""
    resources = []
    for r in view.resources:
        used = tuple(max(0, min(rep, u + delta.get(g, 0))) for g, rep, u in zip(r.gpus, r.replicas, r.used,
                                                                                  strict=True))
        resources.append(SharedGpus(r.resource, r.gpus, r.replicas, used))
    ids = tuple((ids_of[g], u) for r in resources for g, u in zip(r.gpus, r.used, strict=True))
    return NodeSharing(view.strategy, view.one_per_pod, tuple(resources), view.mask, ids)


def fell(old: NodeSharing | None, new: NodeSharing | None) -> dict[str, int]:
    """Per GPU id, by how much its used replicas went down between two states (pods left)."""
    if old is None or new is None:
        return {}
    before = old.used_by_id()
    out = {}
    for gpu, used in new.ids:
        drop = before.get(gpu, used) - used
        if drop > 0:
            out[gpu] = drop
    return out


def thresholds(gpus: Iterable[str], used: Mapping[str, int], pending: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    """For a new shared reservation: per GPU id the used count that shows its replica held (what the node shows
    now, plus the replicas already in flight there, plus this one)."""
    return tuple((g, used.get(g, 0) + pending.get(g, 0) + 1) for g in sorted(gpus))
