"""Which free MIG instances of a node a request for `count` instances of one profile gets (static partitions).

Why this order (issue 23, docs/reference/gpu-sharing.md §2, §3.2):
1. Fewest GPUs: MIG instances have no NVLink or P2P between them, so a pod's instances talk through host
   memory; fewer GPUs is fewer parents to fail and leaves more GPUs free.
2. NUMA-local to each other: that host memory path is shortest within one NUMA node.
3. Partly used GPUs first: taking an instance of a GPU nobody uses spends a GPU that could have gone whole
   (re-partitioned, or MIG disabled again) to a whole-GPU pod.
4. NVLink islands stay whole: when a new GPU must be touched, one whose NVLink island is already in use.
5. Fullest GPUs first (best fit), then the lowest GPU indices, so the answer is deterministic.
Within the chosen GPUs the instances come from the fullest GPU first, lowest start first.

Exact for that lexicographic order: the fewest GPUs is the smallest r whose r largest free counts reach `count`,
and every r-subset is weighed (at most C(8, 4) = 70 on an 8-GPU node). tests/gputopo/core/test_mig_placement.py
checks it against an exhaustive search over every subset.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations

from gputopo.core.mig import MigError, Placement, parse_profile_name


@dataclass(frozen=True, slots=True)
class MigSlot:
    """One MIG device of a static partition: MIG UUID, device name (`1g.18gb`), placement, whether a pod holds it."""

    uuid: str
    profile: str
    placement: Placement
    used: bool = False


@dataclass(frozen=True, slots=True)
class MigGpuState:
    """A MIG-enabled GPU of a node: its index on the node, NUMA node and NVLink island (None: unknown / none)."""

    index: int
    numa: int | None
    island: int | None
    slots: tuple[MigSlot, ...]

    @property
    def in_use(self) -> bool:
        return any(s.used for s in self.slots)

    @property
    def used_slices(self) -> int:
        return sum(s.placement.size for s in self.slots if s.used)

    def free(self, profile: str) -> list[MigSlot]:
        return sorted((s for s in self.slots if s.profile == profile and not s.used), key=lambda s: s.placement.start)


@dataclass(frozen=True, slots=True)
class MigChoice:
    """The instances chosen (MIG UUIDs), the GPUs they are on, and the order key they won by (smaller is better):
    (GPUs, NUMA nodes, untouched GPUs taken, intact islands broken, -used slices of the GPUs, GPU indices)."""

    uuids: tuple[str, ...]
    gpus: tuple[int, ...]
    key: Key


Key = tuple[int, int, int, int, int, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class _Candidate:
    """A GPU's facts the order reads, computed once per request."""

    index: int
    numa: int | None
    island: int | None
    in_use: bool
    used_slices: int
    free: tuple[str, ...]  # free instances of the asked profile, lowest start first


def _candidate(g: MigGpuState, profile: str) -> _Candidate:
    return _Candidate(g.index, g.numa, g.island, g.in_use, g.used_slices, tuple(s.uuid for s in g.free(profile)))


def _key(subset: Sequence[_Candidate], islands_in_use: frozenset[int]) -> Key:
    numa = len({g.numa for g in subset})
    untouched = [g for g in subset if not g.in_use]
    broken = len({g.island for g in untouched if g.island is not None and g.island not in islands_in_use})
    return (len(subset), numa, len(untouched), broken, -sum(g.used_slices for g in subset),
            tuple(sorted(g.index for g in subset)))


def _take(subset: Sequence[_Candidate], count: int) -> tuple[str, ...]:
    order = sorted(subset, key=lambda g: (not g.in_use, -g.used_slices, g.index))
    return tuple(u for g in order for u in g.free)[:count]


def islands_busy(gpus: Iterable[MigGpuState], whole_in_use: Iterable[int | None] = ()) -> frozenset[int]:
    """The NVLink islands in use: those of MIG GPUs with a used instance and those `whole_in_use` names (the
    islands of whole GPUs that pods hold)."""
    return frozenset(
        {g.island for g in gpus if g.in_use and g.island is not None} | {i for i in whole_in_use if i is not None}
    )


def choose_mig(
    gpus: Sequence[MigGpuState],
    profile: str,
    count: int = 1,
    *,
    islands_in_use: frozenset[int] | None = None,
) -> MigChoice | None:
    """The best `count` free instances of `profile` on one node's MIG GPUs, or None when the node has too few.

    `islands_in_use` defaults to the islands of the given GPUs that have a used instance; pass `islands_busy(...)`
    with the node's whole GPUs in use to count those too. MigError for a bad profile name or count."""
    parse_profile_name(profile)
    if count < 1:
        raise MigError(f"a MIG request needs at least one instance, got {count}")
    indices = [g.index for g in gpus]
    if len(set(indices)) != len(indices):
        raise MigError(f"GPU indices listed twice: {sorted(indices)}")
    busy = islands_busy(gpus) if islands_in_use is None else islands_in_use
    candidates = [c for c in (_candidate(g, profile) for g in gpus) if c.free]
    counts = sorted((len(c.free) for c in candidates), reverse=True)
    if sum(counts) < count:
        return None
    need, reached = 0, 0
    while reached < count:
        reached += counts[need]
        need += 1
    best: tuple[Key, tuple[_Candidate, ...]] | None = None
    for subset in combinations(candidates, need):
        if sum(len(c.free) for c in subset) < count:
            continue
        key = _key(subset, busy)
        if best is None or key < best[0]:
            best = (key, subset)
    assert best is not None  # the `need` largest counts reach `count`
    key, subset = best
    return MigChoice(_take(subset, count), tuple(sorted(c.index for c in subset)), key)


def first_fit(gpus: Sequence[MigGpuState], profile: str, count: int = 1) -> MigChoice | None:
    """What a topology-blind pick gives (the default scheduler with NVIDIA's mixed strategy and devices taken in
    order): the first free instances of `profile` by GPU index, then start. For comparison in bench/mig.py."""
    parse_profile_name(profile)
    if count < 1:
        raise MigError(f"a MIG request needs at least one instance, got {count}")
    taken: list[tuple[int, str]] = []
    for g in sorted(gpus, key=lambda g: g.index):
        for slot in g.free(profile):
            if len(taken) < count:
                taken.append((g.index, slot.uuid))
    if len(taken) < count:
        return None
    chosen = tuple(sorted({i for i, _ in taken}))
    subset = [_candidate(g, profile) for g in gpus if g.index in chosen]
    return MigChoice(tuple(u for _, u in taken), chosen, _key(subset, islands_busy(gpus)))
