"""Placement of replicas of shared GPUs (time-slicing or MPS, issue 22): which GPUs of a node, and which node.

A request for k replicas is a request for k replicas on k DISTINCT GPUs: two replicas of one GPU give the
container that GPU once (NVIDIA's Allocate de-duplicates them), so they would silently halve what the pod asked for
(NVIDIA #491, gpu-operator #386). Only GPUs with a free replica count; what is free is the node's published count
less the replicas that binds in flight hold (extender.state.sharing), so concurrent binds never over-book a GPU.

Within a node:
- k > 1: the best ring of k GPUs with a free replica, as the pod will see it: time-slicing (or MPS) with m other
  pods on a GPU leaves the pod 1/(m + 1) of it, so a set's effective GB/s is its ring (the core allocator's
  estimate) over 1 + the most other pods on any of its GPUs. Exact: for each level m of replicas in use, the
  allocator's best subset of the GPUs with at most m in use; the best of those (fewest pods shared with on ties);
- k == 1: the GPU with the most replicas used that still has one free (packing: pods that share go where sharing
  already is, never past the replica count); on a node where no shared GPU is in use, the GPU the allocator would
  give a 1-GPU pod, which leaves the best-connected remainder.
Across nodes (0-10): k == 1 first onto a GPU already shared (most replicas used first), then onto a node already
sharing, and only then breaks into a node whose shared GPUs are all idle, the slowest such node first, so whole
nodes and free NVLink islands stay for the pods that need whole GPUs; k > 1 by the effective GB/s (the bands of
extender.placement.scoring), then onto nodes already sharing within a band.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from extender.placement import reasons
from extender.placement.reasons import Failed, Unresolvable
from extender.placement.scoring import MAX_SCORE, priority_scores
from extender.state.cache import CORDONED, NodeEntry
from gputopo.core import Topology, allreduce_gbps, best_possible_gbps, best_subset
from gputopo.core.bitset import mask_of

MAX_CHARS = 400
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class SharedChoice:
    """The replicas a node would give a pod: one on each of `gpus` (indices), and how full those GPUs are."""

    resource: str
    strategy: str
    gpus: tuple[int, ...]
    gbps: float  # the ring over `gpus` (0.0 for one), before sharing
    effective_gbps: float  # the ring over 1 + the most other pods on one of `gpus`
    before: tuple[int, ...]  # replicas used on each chosen GPU before this pod (published + in flight)
    replicas: tuple[int, ...]
    rank: tuple[float, ...]  # higher is better (what prioritize orders nodes by)


@lru_cache(maxsize=256)
def _not_shared(resource: str) -> Unresolvable:
    """One refusal object per resource name: most nodes of a mixed cluster give it, on every request."""
    return Unresolvable(reasons.not_shared(resource))


def choice_key(entry: NodeEntry, resource: str, size: int, pending: Mapping[str, int], largest: int
               ) -> Hashable | None:
    """Everything shared_choice depends on, for the memo (None: not worth remembering, the answer is immediate).
    The largest container's request matters only where failRequestsGreaterThanOne is set, so elsewhere pods of one
    size share answers however their containers split it."""
    sharing = entry.sharing
    view = sharing.resource(resource) if sharing is not None else None
    if entry.topo is None or sharing is None or view is None:
        return None
    ids = entry.topo.ids
    per_request = largest if sharing.one_per_pod else None
    return (entry.fingerprint, entry.unhealthy_mask, entry.unschedulable, view.gpus, view.replicas, view.used,
            tuple(pending.get(ids[g], 0) for g in view.gpus), sharing.strategy, sharing.one_per_pod, resource,
            size, per_request)


def shared_choice(entry: NodeEntry, resource: str, size: int, pending: Mapping[str, int], largest: int
                  ) -> SharedChoice | Failed | Unresolvable:
    """The replicas `entry` would give a pod asking for `size` of `resource`, or why it cannot. `largest` is the
    most one of its containers asks (Need.largest_request): failRequestsGreaterThanOne is checked
    by the plugin's Allocate per container, as NVIDIA's is, so it bounds that, not the pod's total; the pod's
    containers still get `size` distinct GPUs between them (extender.state.pods.split_plan)."""
    if entry.topo is None:
        return Unresolvable(reasons.node_problem(entry.problem or reasons.NO_TOPOLOGY))
    if entry.unschedulable:
        return Unresolvable(CORDONED)
    sharing = entry.sharing
    view = sharing.resource(resource) if sharing is not None else None
    if sharing is None or view is None:
        return _not_shared(resource)
    if largest > 1 and sharing.one_per_pod:
        return Unresolvable(reasons.one_replica_per_container(largest, resource))
    if len(view.gpus) < size:
        return Unresolvable(reasons.too_few_shared(size, len(view.gpus), resource))
    topo = entry.topo
    ids = topo.ids
    free: list[int] = []
    used: dict[int, int] = {}
    replicas: dict[int, int] = {}
    full = bad = 0
    for g, rep, u in zip(view.gpus, view.replicas, view.used, strict=True):
        taken = u + pending.get(ids[g], 0)
        used[g], replicas[g] = taken, rep
        if entry.unhealthy_mask >> g & 1:
            bad |= 1 << g
        elif taken >= rep:
            full |= 1 << g
        else:
            free.append(g)
    if len(free) < size:
        return Failed(reasons.too_few_free_replicas(size, len(free), full, bad, resource))
    busy = [g for g in free if used[g] > 0]
    node_busy = any(used[g] > 0 for g in view.gpus)
    if size == 1:
        if busy:
            most = max((used[g], used[g] / replicas[g]) for g in busy)
            ties = [g for g in busy if (used[g], used[g] / replicas[g]) == most]
            gpus = best_subset(topo, ties, 1).gpus
            rank: tuple[float, ...] = (2.0, float(most[0]), most[1])
        else:
            gpus = best_subset(topo, free, 1).gpus
            if node_busy:
                rank = (1.0, 0.0, 0.0)
            else:  # breaking an idle node: the one whose idle GPUs make the slowest large ring goes first
                n = min(8, len(free))
                rank = (0.0, 0.0, -best_possible_gbps(topo, n, free) if n > 1 else 0.0)
        gbps = effective = 0.0
    else:
        gpus, gbps, effective = _best_shared_ring(topo, free, used, size)
        rank = (effective, 1.0 if node_busy else 0.0)
    return SharedChoice(resource, sharing.strategy, tuple(gpus), gbps, effective, tuple(used[g] for g in gpus),
                        tuple(replicas[g] for g in gpus), rank)


def _best_shared_ring(topo: Topology, free: list[int], used: Mapping[int, int], size: int
                      ) -> tuple[tuple[int, ...], float, float]:
    """The k GPUs of `free` with the best ring over 1 + the most other pods on one of them (module docstring)."""
    best: tuple[float, int, tuple[int, ...], float] | None = None
    for level in sorted({used[g] for g in free}):
        pool = [g for g in free if used[g] <= level]
        if len(pool) < size:
            continue
        gpus = best_subset(topo, pool, size).gpus
        ring = allreduce_gbps(topo, gpus)
        worst = max(used[g] for g in gpus)
        effective = ring / (1 + worst)
        if best is None or effective > best[0] + _EPS:
            best = (effective, worst, gpus, ring)
    assert best is not None  # the last level holds every free GPU, and there are at least `size`
    return best[2], best[3], best[0]


def shared_scores(choices: Sequence[SharedChoice | None]) -> list[int]:
    """0-10 per node (0 where the pod cannot go). One replica: distinct ranks from the best down, a level each
    while there are levels, proportionally beyond; several: the GB/s bands of extender.placement.scoring."""
    if any(c is not None and len(c.gpus) > 1 for c in choices):
        return priority_scores([(c.rank[0], c.rank[1]) if c is not None else None for c in choices])
    distinct = sorted({c.rank for c in choices if c is not None}, reverse=True)
    levels = MAX_SCORE + 1
    n = len(distinct)
    level = {r: MAX_SCORE - (i if n <= levels else i * levels // n) for i, r in enumerate(distinct)}
    return [level[c.rank] if c is not None else 0 for c in choices]


def explain_shared(node: str, choice: SharedChoice) -> str:
    """`n1 GPU 3: a replica of nvidia.com/gpu.shared (time-slicing); shares GPU 3 with 2 pods, 3 of 7 replicas
    used` (counts after this pod)."""
    k = len(choice.gpus)
    what = "a replica" if k == 1 else f"{k} replicas"
    head = (f"{node} GPU{'s' if k > 1 else ''} {reasons.gpu_list(mask_of(choice.gpus))}: {what} of "
            f"{choice.resource} ({choice.strategy})")
    if k > 1:
        head += f" on {k} distinct GPUs, ring {choice.gbps:.1f} GB/s"
        if choice.effective_gbps < choice.gbps - _EPS:
            head += f" ({choice.effective_gbps:.1f} GB/s shared with the busiest GPU's pods)"
    parts = [head]
    for g, before, rep in zip(choice.gpus, choice.before, choice.replicas, strict=True):
        if before:
            parts.append(f"shares GPU {g} with {before} pod{'s' if before != 1 else ''}, {before + 1} of {rep} "
                         "replicas used")
        else:
            parts.append(f"GPU {g} not shared with any pod yet, 1 of {rep} replicas used")
    text = "; ".join(parts)
    return text if len(text) <= MAX_CHARS else text[:MAX_CHARS - 3] + "..."
