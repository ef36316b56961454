"""GetPreferredAllocation for replicas: which physical GPUs, then which of their free replicas.

The kubelet's question names replica ids; the answer is decided on their parents, because that is what a container
gets: k replicas are k distinct GPUs (NVIDIA only spreads by load, so two replicas of one GPU happen: NVIDIA #491,
gpu-operator #386), the best-connected k among those with a free replica (the core allocator, as for whole GPUs),
or the extender's plan when one fits. One replica goes where sharing costs least: a GPU already shared (the most
used first: pack, never past its replicas), else a fresh GPU outside a whole untouched NVLink island, the one least
connected to the other untouched GPUs. Like gpuplugin.deviceplugin.preferred this never raises: the kubelet fails
admission on an error here, and an imperfect answer only costs a worse choice.

The answer is always a set the resource's Allocate accepts (distinct GPUs unless distinctGpus is false, one replica
under failRequestsGreaterThanOne), unless the kubelet's must_include ids themselves are refused. When no such set
of the size asked exists (3 replicas on distinct GPUs where 2 GPUs have a free one), the answer is the largest
accepted part, fewer ids than asked, and the problem says why: the kubelet fills the rest itself and Allocate
refuses it with its own clear message, instead of this answer being the one refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from gpuplugin.deviceplugin.devices import Device
from gpuplugin.deviceplugin.plans import PlanSource
from gpuplugin.deviceplugin.preferred import FallbackReason, Preference, Source
from gputopo.contract import ReplicaIdError, replica_parent
from gputopo.core.allocator import best_subset
from gputopo.core.topology import Topology


@dataclass(frozen=True)
class Replicas:
    """The replica side of one shared resource: replica device by id, parent device by index, replicas per GPU."""

    by_id: Mapping[str, Device]
    parents: Mapping[int, Device]
    replicas: Mapping[int, int]
    distinct: bool
    at_most_one: bool = False  # failRequestsGreaterThanOne: Allocate refuses more than one replica


def largest_accepted(r: Replicas, available: int, parents: int) -> tuple[int, str]:
    """The most replicas one Allocate of this resource accepts from `available` free replicas on `parents` GPUs,
    and what bounds it (for the problem line)."""
    if r.at_most_one:
        return 1, "failRequestsGreaterThanOne allows 1 replica per request"
    if r.distinct:
        return parents, f"{parents} GPUs have a free replica and each replica must be a distinct GPU"
    return available, f"{available} valid replicas are available"


def _number(device_id: str) -> int:
    try:
        return replica_parent(device_id)[1]
    except ReplicaIdError:
        return 0


def _sorted(ids: Sequence[str], r: Replicas) -> tuple[str, ...]:
    return tuple(sorted(ids, key=lambda x: (r.by_id[x].index, _number(x))))


def sharing_cost(topo: Topology, free: Mapping[int, int], replicas: Mapping[int, int], gpu: int) -> tuple:
    """Smaller is cheaper: a shared GPU before a fresh one (the fullest first), then a fresh GPU outside a whole
    untouched NVLink island, then the one least connected to the other untouched GPUs."""
    used = replicas[gpu] - free[gpu]
    if used > 0:
        return (0, -used, 0, 0.0, gpu)
    untouched = {g for g, f in free.items() if f == replicas[g]}
    island = next((set(i) for i in topo.nvlink_islands() if gpu in i), {gpu}) & set(replicas)
    whole_island = 1 if len(island) > 1 and island <= untouched else 0
    reach = sum(topo.gbps(gpu, other) for other in untouched if other != gpu)
    return (1, 0, whole_island, reach, gpu)


def choose_replicas(topo: Topology, r: Replicas, available_ids: Sequence[str], must_ids: Sequence[str], size: int,
                    plans: PlanSource | None) -> Preference:
    problems: list[str] = []
    available: list[str] = []
    seen: set[str] = set()
    for x in available_ids:
        if x in seen:
            problems.append(f"available lists {x[:80]!r} twice")
        elif x not in r.by_id:
            problems.append(f"available holds unknown device id {x[:80]!r}")
        else:
            available.append(x)
        seen.add(x)
    avail_set = set(available)
    must = [x for x in dict.fromkeys(must_ids) if x in avail_set]
    if len(must) != len(must_ids):
        problems.append("must_include holds ids that are not available")
    by_parent: dict[int, list[str]] = {}
    for x in available:
        by_parent.setdefault(r.by_id[x].index, []).append(x)
    for ids in by_parent.values():
        ids.sort(key=_number)
    if size <= 0:
        return Preference((), Source.FALLBACK, FallbackReason.BAD_REQUEST, (*problems, f"size {size} <= 0"))
    must_parents = [r.by_id[x].index for x in must]
    if r.distinct and len(set(must_parents)) != len(must_parents):
        # no superset is accepted: answer the kubelet's own ids, adding none Allocate would refuse with them
        return Preference(_sorted(must[:size], r), Source.FALLBACK, FallbackReason.BAD_REQUEST,
                          (*problems, "must_include holds two replicas of one GPU, which Allocate refuses"))
    if len(must) > size:
        return Preference(_sorted(must[:size], r), Source.FALLBACK, FallbackReason.BAD_REQUEST,
                          (*problems, f"must_include has {len(must)} ids, more than the size {size}"))
    free = {g: len(ids) for g, ids in by_parent.items()}
    limit, bound = largest_accepted(r, len(available), len(free))
    if size > limit:
        # no set Allocate accepts: answer the largest part it does (must_include kept: the kubelet's own)
        problems.append(f"{size} replicas asked, no answer Allocate accepts: {bound}")
        size = max(limit, len(must))
        if size == 0:
            return Preference((), Source.FALLBACK, FallbackReason.BAD_REQUEST, tuple(problems))
    need_parents = min(size, len(free)) if not r.distinct else size

    def pick(parents: Sequence[int]) -> tuple[str, ...]:
        chosen: list[str] = list(must)
        taken = {r.by_id[x].index for x in must}
        for g in parents:
            if g not in taken:
                chosen.append(by_parent[g][0])
                taken.add(g)
        spare = sorted((x for g in parents for x in by_parent[g] if x not in chosen),
                       key=lambda x: (-free[r.by_id[x].index], r.by_id[x].index, _number(x)))
        chosen += spare[: max(0, size - len(chosen))]
        return _sorted(chosen[:size], r)

    reason = FallbackReason.BAD_REQUEST if problems else FallbackReason.NO_PLAN
    must_set = sorted(set(must_parents))
    if plans is not None and not problems:
        parent_ids = {r.parents[g].id: g for g in free}
        try:
            plan = plans.pending_plan(list(parent_ids), [r.parents[g].id for g in must_set], need_parents)
        except Exception as e:  # a faulty plan source must not fail pod admission
            reason = FallbackReason.PLAN_ERROR
            problems.append(f"plan source raised {type(e).__name__}: {e}")
        else:
            if plan is not None:
                why = _plan_problem(plan, parent_ids, [r.parents[g].id for g in must_set], need_parents)
                if why is None:
                    return Preference(pick([parent_ids[x] for x in plan]), Source.PLAN)
                reason = FallbackReason.PLAN_REJECTED
                problems.append(why)
    candidates = sorted(free)
    try:
        if need_parents == 1 and not must_set:
            parents = [min(candidates, key=lambda g: sharing_cost(topo, free, r.replicas, g))]
        else:
            parents = list(best_subset(topo, candidates, need_parents, must_set[:need_parents]).gpus)
    except Exception as e:  # the allocator's errors: answer anyway
        problems.append(f"allocator raised {type(e).__name__}: {e}")
        return Preference(pick(candidates[:need_parents]), Source.FALLBACK, FallbackReason.ALLOCATOR_ERROR,
                          tuple(problems))
    return Preference(pick(parents), Source.ALLOCATOR, reason, tuple(problems))


def _plan_problem(plan: object, parent_ids: Mapping[str, int], must: Sequence[str], size: int) -> str | None:
    """Why a shared plan (distinct parent GPU ids) cannot answer the request, or None."""
    if not isinstance(plan, (list, tuple)) or not all(isinstance(x, str) for x in plan):
        return f"plan is not a list of GPU ids: {plan!r}"[:300]
    if len(set(plan)) != len(plan):
        return f"plan repeats GPUs: {list(plan)}"[:300]
    if len(plan) != size:
        return f"plan has {len(plan)} GPUs, the request needs {size}"
    outside = [x for x in plan if x not in parent_ids]
    if outside:
        return f"plan GPUs without a free replica: {', '.join(outside)}"[:300]
    missing = [x for x in must if x not in plan]
    if missing:
        return f"plan lacks the GPUs of must-include replicas: {', '.join(missing)}"[:300]
    return None
