"""The preempt verb: keep a node's victims only if evicting them frees a GPU subset the pod can use.

Rule (documented in docs and the OpenAPI description):
- For each candidate node, the GPUs its victims free are the GPUs of their plans on that node (from the victim's
  plan annotation in full-pod mode, or from the pod cache by UID in meta mode). A victim whose GPUs are unknown
  (no plan: placed before the extender ran) frees none as far as this check goes: conservative, never optimistic.
- After eviction the free set is: free now + freed GPUs that are healthy. If the best subset of that set meets the
  pod's need (count, require-nvlink, min-allreduce-gbps), the node stays with its victims unchanged; otherwise the
  node is dropped from the candidates (evicting there would not let the pod run well, or at all).
- Victims are never trimmed: kube-scheduler already reprieved every victim it could by count and by its other
  resources, so each remaining victim is needed by some filter; removing one would leave the pod unschedulable.
- Among the nodes kept whose victims cost the same as kube-scheduler weighs them (PDB violations, highest victim
  priority, sum of victim priorities, number of victims), only those whose freed subset is the fastest stay:
  kube-scheduler picks among equal-cost candidates without knowing GPUs, so the slower ones are not offered. A
  node whose victims' priorities are not all known (a meta victim the pod cache does not hold) is not compared.
Nodes the extender does not know or that publish no topology are dropped too (preemption there cannot help).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from extender.placement.engine import Placement
from extender.state.cache import NodeCache
from extender.state.pods import Need
from gputopo.contract import Plan
from gputopo.core.bitset import mask_of


@dataclass(frozen=True)
class Victim:
    uid: str
    plan: Plan | None  # None: look it up by UID
    priority: int | None = None  # None: look it up by UID in the pod cache


@dataclass(frozen=True)
class NodeVictims:
    victims: tuple[Victim, ...]
    pdb_violations: int


def keep_victims(
    cache: NodeCache,
    placement: Placement,
    need: Need,
    candidates: Mapping[str, NodeVictims],
    plan_of: Callable[[str], Plan | None],
) -> dict[str, NodeVictims]:
    """The candidates whose eviction frees a suitable subset, the fastest among equal victim costs (module rule)."""
    if need.size == 0:
        return dict(candidates)
    out: dict[str, NodeVictims] = {}
    speed: dict[str, float] = {}
    for node, nv in candidates.items():
        entry = cache.nodes.get(node)
        if entry is None or entry.topo is None or entry.total < need.size:
            continue
        freed = _freed_mask(entry.index, node, nv.victims, plan_of)
        healthy = ((1 << entry.topo.size) - 1) & ~entry.unhealthy_mask
        if entry.sharing is not None:  # a shared victim frees a replica, never a whole GPU
            healthy &= ~entry.sharing.mask
        after = (cache.free_mask(entry) | freed) & healthy
        if after.bit_count() < need.size:
            continue
        fit = placement.fit(entry, after, need)
        if fit.alloc is not None:
            out[node] = nv
            speed[node] = fit.gbps
    return _fastest_per_cost(out, speed, cache)


# Victim cost as kube-scheduler orders preemption candidates (pickOneNodeForPreemption): lower is better.
Cost = tuple[int, int, int, int]


def victim_cost(nv: NodeVictims, cache: NodeCache) -> Cost | None:
    """(PDB violations, highest victim priority, sum of priorities, victims), or None when a priority is unknown."""
    priorities = []
    for v in nv.victims:
        priority = v.priority
        if priority is None:
            rec = cache.pods.get(v.uid)
            priority = rec.priority if rec is not None else None
        if priority is None:
            return None
        priorities.append(priority)
    return (nv.pdb_violations, max(priorities, default=-(2**31)), sum(priorities), len(priorities))


def _fastest_per_cost(kept: dict[str, NodeVictims], speed: Mapping[str, float],
                      cache: NodeCache) -> dict[str, NodeVictims]:
    best: dict[Cost, float] = {}
    costs = {node: victim_cost(nv, cache) for node, nv in kept.items()}
    for node, cost in costs.items():
        if cost is not None:
            best[cost] = max(best.get(cost, 0.0), speed[node])
    return {node: nv for node, nv in kept.items()
            if costs[node] is None or speed[node] >= best[costs[node]] * (1 - 1e-9)}


def _freed_mask(index: Mapping[str, int], node: str, victims: Sequence[Victim],
                plan_of: Callable[[str], Plan | None]) -> int:
    freed = 0
    for v in victims:
        plan = v.plan if v.plan is not None else plan_of(v.uid)
        if plan is None or plan.node != node:
            continue
        freed |= mask_of(index[i] for i in plan.ids if i in index)
    return freed
