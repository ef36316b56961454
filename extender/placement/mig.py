"""Placement of MIG instances (issue 23): which free instances of a node, and which node.

An NVLink island counts as in use when a MIG GPU of it has an instance held or a whole GPU of it is held (the
GPU's published `peers`), so MIG pods go first to islands that are broken already.

A pod asks for k instances of one profile: `nvidia.com/mig-<profile>: k` on a node of NVIDIA's mixed strategy, or
`nvidia.com/gpu: k` on a node of the single strategy (every instance of one profile, advertised as the GPU
resource). Within a node the core's `choose_mig` decides (gputopo.core.mig_placement: fewest GPUs, one NUMA node,
partly used GPUs first, NVLink islands in use first, fullest first; exact). Across nodes the same order decides,
its key without the GPU indices: a pod goes where it touches the fewest GPUs nobody uses, so whole GPUs and whole
free islands stay for whole-GPU pods and for the large profiles, and it waits only when no node has enough free
instances. Free means advertised as the asked resource, not held (published), not unhealthy, and not planned for a
pod in flight (the node's instance reservations), so one instance is never planned twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from extender.placement import reasons
from extender.placement.reasons import Failed, Unresolvable
from extender.placement.scoring import MAX_SCORE
from extender.state.cache import CORDONED, NodeEntry
from extender.state.mig import NodeMig
from gputopo.contract import Plan, is_mig_resource
from gputopo.core.mig import PROFILE_TABLES, MigError, Placement, profile_for_resource
from gputopo.core.mig_placement import Key, MigGpuState, MigSlot, choose_mig, islands_busy
from gputopo.podspec import INIT, ContainerNeed

MAX_CHARS = 400
_OTHER = "-"  # prefix of a slot's profile that is not offered to this request (never a profile name)


@dataclass(frozen=True, slots=True)
class MigChoiceOnNode:
    """The instances a node would give a pod (MIG UUIDs), the GPUs (published indices) and, per GPU, instances held
    before this pod (published + in flight) and in all; `key` is choose_mig's order key (smaller is better)."""

    resource: str
    profile: str
    uuids: tuple[str, ...]
    gpus: tuple[int, ...]
    held: tuple[int, ...]
    instances: tuple[int, ...]
    taken: tuple[int, ...]  # of this pod's instances, how many on each GPU
    key: Key

    @property
    def rank(self) -> Key:
        """What prioritize orders nodes by (smaller is better): choose_mig's whole key, its GPU indices last, as
        the core orders GPU sets; on a fleet this tie-break made fewer waits than the node order (bench.mig)."""
        return self.key


@lru_cache(maxsize=256)
def unknown_profile(resource: str, models: frozenset[str]) -> str | None:
    """Why no GPU model the node has knows the resource's profile (None: some does, or no model is known).
    Uses NVIDIA's tables (gputopo.core.mig); a model without a table is not judged."""
    tables = [t for t in PROFILE_TABLES if t.model in models] if models else list(PROFILE_TABLES)
    if not tables:
        return None
    problems = []
    for t in tables:
        try:
            profile_for_resource(resource, t.profiles)
            return None
        except MigError as e:
            problems.append(f"{t.model}: {e}" if models else str(e))
    if not models:
        return f"{resource!r} names no MIG profile of any GPU model NVIDIA documents"
    return "; ".join(problems)[:MAX_CHARS]


def _states(view: NodeMig, resource: str, profile: str, unhealthy: frozenset[str], pending: frozenset[str]
            ) -> list[MigGpuState]:
    out = []
    for g in view.gpus:
        slots = []
        for i in g.instances:
            held = i.used or i.uuid in pending
            offered = i.resource == resource and i.uuid not in unhealthy
            name = i.profile if offered and i.profile == profile else _OTHER + i.profile
            slots.append(MigSlot(i.uuid, name, Placement(i.start, i.size), held))
        out.append(MigGpuState(g.index, g.numa, g.island, tuple(slots)))
    return out


def busy_islands(view: NodeMig, states: Sequence[MigGpuState], whole_held: frozenset[str]) -> frozenset[int]:
    """The NVLink islands in use: those of MIG GPUs with an instance held, and those with a whole GPU held (a peer
    in `whole_held`: the state's "used" and the whole GPUs reserved for binds in flight)."""
    whole = [g.island for g in view.gpus if g.island is not None and not whole_held.isdisjoint(g.peers)]
    return islands_busy(states, whole)


def mig_choice(entry: NodeEntry, resource: str, size: int, pending: frozenset[str], constrained: bool = False,
               whole_held: frozenset[str] = frozenset()) -> MigChoiceOnNode | Failed | Unresolvable:
    """The instances `entry` would give a pod asking for `size` of `resource`, or why it cannot."""
    view = entry.mig
    if view is None:
        if entry.topo is None and entry.problem:  # an unreadable state or topology: its words name the field
            return Unresolvable(reasons.node_problem(entry.problem))
        return Unresolvable(f"has no MIG GPUs (asks for {resource})")
    if is_mig_resource(resource):  # the pod's own mistake first: it is the same on every node
        problem = unknown_profile(resource, view.models)
        if problem is not None:
            return Unresolvable(problem)
    if entry.unschedulable:
        return Unresolvable(CORDONED)
    if view.strategy == "none":
        return Unresolvable(view.mig.reason or "MIG devices are not advertised (MIG strategy none)")
    profile = view.profile_of(resource)
    if profile is None:
        have = sorted({i.profile for g in view.gpus for i in g.instances if i.resource is not None})
        return Unresolvable(f"has no {resource} instances (MIG strategy {view.strategy}; advertises "
                            f"{', '.join(have) or 'none'})", category=f"has no {resource} instances")
    if constrained and size > 1:
        return Unresolvable(f"asks for NVLink or a minimum GB/s between {size} MIG instances: MIG instances have no "
                            "NVLink or P2P between them")
    total = sum(1 for g in view.gpus for i in g.instances if i.resource == resource)
    if total < size:
        return Unresolvable(f"needs {size} {profile} instances, node has {total} in all",
                            category=f"needs {size} {profile} instances, more than the node has")
    unhealthy = entry.unhealthy_ids
    states = _states(view, resource, profile, unhealthy, pending)
    choice = choose_mig(states, profile, size, islands_in_use=busy_islands(view, states, whole_held))
    if choice is None:
        free = sum(len(g.free(profile)) for g in states)
        held = sum(1 for g in states for s in g.slots if s.profile == profile and s.used)
        bad = sum(1 for g in view.gpus for i in g.instances if i.resource == resource and i.uuid in unhealthy
                  and not i.used)
        words = f"needs {size} {profile} instance{'s' if size != 1 else ''}, {free} free: {held} in use"
        return Failed(words + (f", {bad} unhealthy" if bad else ""),
                      category=f"needs {size} {profile} instance{'s' if size != 1 else ''}, fewer free")
    by_gpu = {g.index: g for g in states}
    chosen = set(choice.uuids)
    held_before = tuple(sum(1 for s in by_gpu[i].slots if s.used) for i in choice.gpus)
    return MigChoiceOnNode(resource, profile, choice.uuids, choice.gpus, held_before,
                           tuple(len(by_gpu[i].slots) for i in choice.gpus),
                           tuple(sum(1 for s in by_gpu[i].slots if s.uuid in chosen) for i in choice.gpus),
                           choice.key)


def mig_scores(choices: Sequence[MigChoiceOnNode | None]) -> list[int]:
    """0-10 per node (0 where the pod cannot go): distinct ranks from the best down, a level each while there are
    levels, proportionally beyond."""
    distinct = sorted({c.rank for c in choices if c is not None})
    levels = MAX_SCORE + 1
    n = len(distinct)
    level = {r: MAX_SCORE - (i if n <= levels else i * levels // n) for i, r in enumerate(distinct)}
    return [level[c.rank] if c is not None else 0 for c in choices]


def split_instances(uuids: Sequence[str], containers: Sequence[ContainerNeed]) -> dict[str, list[str]]:
    """The plan's instances per container, as the kubelet hands devices out: app containers and sidecars get
    disjoint parts in order; an init container reuses the first app container's (it runs before it)."""
    left = list(uuids)
    parts: dict[str, list[str]] = {}
    inits = []
    for c in containers:
        if c.count <= 0:
            continue
        if c.kind == INIT:
            inits.append(c)
            continue
        if c.count > len(left):
            raise ValueError(f"container {c.name} needs {c.count} MIG instances, {len(left)} left of the plan")
        parts[c.name], left = left[:c.count], left[c.count:]
    first = next((parts[c.name] for c in containers if c.name in parts), list(uuids))
    for c in inits:
        pool = first if c.count <= len(first) else list(uuids)
        parts[c.name] = pool[:c.count]
    return parts


def explain_mig(node: str, choice: MigChoiceOnNode) -> str:
    """`n1: mig-1g.18gb on GPU 2, 3 of 7 in use` (counts after this pod), one clause per GPU."""
    what = choice.resource.rsplit("/", 1)[-1] if is_mig_resource(choice.resource) else (
        f"{choice.profile} (as {choice.resource}, MIG single)")
    parts = [f"{what}{f' x{k}' if k > 1 else ''} on GPU {g}, {h + k} of {n} in use"
             for g, h, n, k in zip(choice.gpus, choice.held, choice.instances, choice.taken, strict=True)]
    text = f"{node}: " + "; ".join(parts)
    return text if len(text) <= MAX_CHARS else text[:MAX_CHARS - 3] + "..."


def mig_plan(node: str, choice: MigChoiceOnNode, containers: Sequence[ContainerNeed]) -> Plan:
    """The plan bind writes: the chosen MIG UUIDs per container, in the pod's container order (no GB/s: MIG
    instances have no NVLink between them)."""
    parts = split_instances(choice.uuids, containers)
    order = [c.name for c in containers if c.name in parts]
    return Plan(node=node, resource=choice.resource, gbps=0.0,
                containers=tuple((name, tuple(parts[name])) for name in order))


def is_mig_plan(entry: NodeEntry | None, plan: Plan) -> bool:
    return is_mig_resource(plan.resource) or (entry is not None and entry.serves_mig(plan.resource))


def explain_plan(entry: NodeEntry, plan: Plan, pending: frozenset[str]) -> str | None:
    """The words of a MIG plan from the node's instances now (published held, in flight, and the plan's own)."""
    view = entry.mig
    if view is None:
        return None
    ids = plan.ids
    gpus, held, instances, taken = [], [], [], []
    profile = ""
    for g in view.gpus:
        mine = [i for i in g.instances if i.uuid in ids]
        if not mine:
            continue
        profile = mine[0].profile
        gpus.append(g.index)
        instances.append(len(g.instances))
        taken.append(len(mine))
        held.append(sum(1 for i in g.instances if (i.used or i.uuid in pending) and i.uuid not in ids))
    if not gpus:
        return None
    choice = MigChoiceOnNode(plan.resource, profile, tuple(sorted(ids)), tuple(gpus), tuple(held), tuple(instances),
                             tuple(taken), (0, 0, 0, 0, 0, ()))
    return explain_mig(plan.node, choice)
