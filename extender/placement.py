"""Placement answers for filter, prioritize, preempt and bind, memoised so thousands of nodes cost a few lookups.

Every answer depends only on (topology fingerprint, free GPU set, pod need): nodes of one model in the same state
share one computation, and the core's own memo (keyed the same way) stays warm. Reasons for a count shortfall
depend on (used, unhealthy, reserved masks, size) and are memoised the same way.

Packing value of a choice (higher is better, in [0, 1]):
    loss  = sum over common sizes s in (2, 4, 8), s <= node size, of
            s * (best ring of s GPUs the free set can form - the same after taking the choice) / (best on empty node)
    tight = 1 - GPUs left free after the choice / node size
    packing = 0.85 * (1 - min(loss, 14) / 14) + 0.15 * tight
Loss is weighted by size because a large free island is rarer and more valuable than a small one: taking 1 GPU
from a whole free 8-GPU NVSwitch node loses the node's 8-GPU capability (loss 8), while taking the last free GPU of
another node loses nothing; taking 2 GPUs out of 3 free loses less than breaking a node's only free pair.

Value of a choice (what prioritize ranks nodes by, `island_values`):
    value = its all-reduce GB/s - island_penalty x (GB/s of the best rings of the larger common sizes it breaks
            where no other candidate node offers an equally fast free ring of that size)
in absolute GB/s, floored at 1% of its GB/s. While whole NVSwitch nodes are plentiful a 2-GPU pod takes the fastest
pair; once the last one is left, it prefers a node whose 8-GPU island is already broken, or a PCIe server whose
8-GPU ring was slow anyway, keeping the island for the 8-GPU pod that needs it.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import accumulate, compress, repeat
from operator import is_
from typing import Any

from extender.cache import CORDONED, NodeCache, NodeEntry, PlacementState
from extender.pods import Need
from extender.scoring import priority_scores
from gputopo.core import Allocation, Topology, best_possible_gbps, best_subset
from gputopo.core.bitset import bits, mask_of

COMMON_SIZES = (2, 4, 8)
# ExtenderConfig.island_penalty and island_spare (flags --island-penalty, --island-spare) say how much of a scarce
# larger free island's all-reduce GB/s a choice must gain to be worth breaking it (island_values). Defaults chosen
# with bench/placement.py over three seeds and two fleets: greedy (penalty 0) sends 2- and 4-GPU jobs to whole
# NVSwitch nodes and starves 8-GPU jobs (57 GB/s mean vs 149 for blind placement); penalty 1.0 with 4 spare islands
# keeps every request size at or above the blind baselines and the cluster-wide mean above them.
VALUE_FLOOR = 0.01
PACKING_DIGITS = 4
MAX_LOSS = float(sum(COMMON_SIZES))
_MEMO_LIMIT = 200_000
_EPS = 1e-9
UNKNOWN_NODE = "unknown to the GPU extender (no such Node seen)"
__all__ = ["CORDONED", "UNKNOWN_NODE", "FilterOutcome", "Fit", "NoFit", "Placement"]

# The core's memo tables are plain dicts. The verbs all run on the event loop, but an embedding program (the demo,
# a test) may call placement from other threads too: one lock keeps two callers from resizing them at once.
_CORE_LOCK = threading.Lock()


class NoFit(Exception):
    """The pod cannot be placed on the node; `unresolvable` when no preemption on that node could change that."""

    def __init__(self, reason: str, unresolvable: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.unresolvable = unresolvable


@dataclass(frozen=True, slots=True, eq=False)  # identity: compared by the thousands on the hot path
class Fit:
    alloc: Allocation | None
    gbps: float
    packing: float
    failure: str | None = None
    unresolvable: bool = False
    # (size, best ring GB/s of the free set, the same after the choice) for each common size above the request
    islands: tuple[tuple[int, float, float], ...] = ()


NO_FIT = Fit(None, 0.0, 0.0, "does not fit")


class Failed(str):
    """Filter reason of a node that cannot take the pod now; evicting pods there could change that."""


class Unresolvable(str):
    """Filter reason of a node that no preemption can make fit (FailedAndUnresolvableNodes)."""


@dataclass(frozen=True, slots=True)
class _Facts:
    """Per topology fingerprint: what the empty node can do."""

    min_nvlink_gbps: float | None
    best_empty: dict[int, float]  # filled lazily, per size


@dataclass
class FilterOutcome:
    passed: list[str]
    failed: dict[str, str]
    unresolvable: dict[str, str]


def need_key(need: Need) -> tuple[int, bool, float]:
    """A plain tuple (hashed in C) for memo keys: the dataclass's own hash runs Python code per call."""
    return (need.size, need.require_nvlink, need.min_gbps)


def gpu_list(mask: int) -> str:
    """GPU indices as ranges: 0-3,6."""
    idx = bits(mask)
    parts = []
    i = 0
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        parts.append(str(idx[i]) if i == j else f"{idx[i]}-{idx[j]}" if j > i + 1 else f"{idx[i]},{idx[j]}")
        i = j + 1
    return ",".join(parts)


def _fmt(gbps: float) -> str:
    return f"{gbps:.1f} GB/s"


def island_values(counts: Mapping[Fit, int], penalty: float, spare: int) -> list[float]:
    """Each distinct fit's value: its GB/s, less `penalty` x the GB/s of every larger island it breaks that is
    scarce, i.e. fewer than `spare` other candidate nodes still offer a free ring of that size at least as fast.
    Breaking one of many equal islands costs nothing (a lightly loaded cluster stays greedy); breaking one of the
    last few is paid for."""
    raw: dict[int, list[tuple[float, int]]] = {}
    for f, n in counts.items():
        for s, before, _after in f.islands:
            raw.setdefault(s, []).append((before, n))
    # per size: island GB/s ascending and how many nodes offer at least each, so a lookup is a bisection
    supply: dict[int, tuple[list[float], list[int]]] = {}
    for s, pairs in raw.items():
        pairs.sort()
        at_least = list(accumulate(reversed([n for _, n in pairs])))[::-1]
        supply[s] = ([b for b, _ in pairs], at_least)
    values = []
    for f in counts:
        loss = 0.0
        for s, before, after in f.islands:
            befores, at_least = supply[s]
            others = at_least[bisect_left(befores, before - _EPS)] - 1  # nodes in the same state count too
            if others < spare:
                loss += max(before - after, 0.0)
        values.append(max(f.gbps - penalty * loss, VALUE_FLOOR * f.gbps))
    return values


class Placement:
    def __init__(self, cache: NodeCache) -> None:
        self.cache = cache
        self._fits: dict[tuple[str, int, tuple[int, bool, float]], Fit] = {}
        self._facts: dict[str, _Facts] = {}
        self._verdict_tables: dict[tuple[int, bool, float], dict[Any, Any]] = {}
        self._score_tables: dict[tuple[int, bool, float], dict[Any, Any]] = {}

    # -- memoised building blocks -----------------------------------------------------------------------------

    def facts(self, topo: Topology) -> _Facts:
        hit = self._facts.get(topo.fingerprint)
        if hit is not None:
            return hit
        n = topo.size
        nv = [topo.gbps(i, j) for i in range(n) for j in range(i + 1, n) if topo.link(i, j).kind.is_nvlink]
        facts = _Facts(min(nv) if nv else None, {})
        self._facts[topo.fingerprint] = facts
        return facts

    def best_empty(self, topo: Topology, size: int) -> float:
        facts = self.facts(topo)
        value = facts.best_empty.get(size)
        if value is None:
            with _CORE_LOCK:
                value = best_possible_gbps(topo, size)
            facts.best_empty[size] = value
        return value

    def fit(self, entry: NodeEntry, free: int, need: Need) -> Fit:
        """Best subset of `free` for the need on this node, with its packing value, or why there is none."""
        assert entry.topo is not None
        key = (entry.fingerprint, free, need_key(need))
        hit = self._fits.get(key)
        if hit is not None:
            return hit
        fit = self._compute(entry.topo, free, need)
        if len(self._fits) >= _MEMO_LIMIT:
            self._fits.clear()
        self._fits[key] = fit
        return fit

    def _compute(self, topo: Topology, free: int, need: Need) -> Fit:
        size = need.size
        free_count = free.bit_count()
        if size > free_count:
            return Fit(None, 0.0, 0.0, f"needs {size} GPUs, {free_count} free")
        free_idx = bits(free)
        with _CORE_LOCK:
            alloc = best_subset(topo, free_idx, size)
        gbps = alloc.allreduce_gbps
        if need.constrained:
            problem = self._constraint_problem(topo, alloc, need)
            if problem is not None:
                return Fit(None, gbps, 0.0, problem[0], problem[1])
        rings = self._rings(topo, free, alloc)
        islands = tuple((s, before, after) for s, before, after in rings if s > size and s <= free_count)
        return Fit(alloc, gbps, self._packing(topo, free_count - size, rings), islands=islands)

    def _rings(self, topo: Topology, free: int, alloc: Allocation) -> list[tuple[int, float, float]]:
        """For each common size the node has: the best ring of that size its free GPUs form, before and after the
        choice (absolute GB/s). Packing weighs the loss relative to the node; island value weighs it absolutely
        (breaking an NVSwitch node's 8-GPU island costs more than a PCIe server's)."""
        left = free & ~mask_of(alloc.gpus)
        free_count, left_count = free.bit_count(), left.bit_count()
        out = []
        for s in COMMON_SIZES:
            if s > topo.size:
                break
            with _CORE_LOCK:
                before = best_possible_gbps(topo, s, bits(free)) if free_count >= s else 0.0
                after = best_possible_gbps(topo, s, bits(left)) if left_count >= s else 0.0
            out.append((s, before, after))
        return out

    def _constraint_problem(self, topo: Topology, alloc: Allocation, need: Need) -> tuple[str, bool] | None:
        size, gbps = need.size, alloc.allreduce_gbps
        facts = self.facts(topo)
        if need.require_nvlink:
            floor = facts.min_nvlink_gbps
            if floor is None:
                return f"requires NVLink: this node's GPUs have no NVLink ({topo.fabric})", True
            if gbps + _EPS < floor:
                best = self.best_empty(topo, size)
                if best + _EPS < floor:
                    return (f"requires an NVLink ring of {size} GPUs: none exists on this node "
                            f"(best {_fmt(best)} even when empty)", True)
                chosen = gpu_list(mask_of(alloc.gpus))
                return (f"requires an NVLink ring of {size} GPUs: the best free ones (GPU {chosen}) "
                        f"reach {_fmt(gbps)} over PCIe", False)
        if need.min_gbps > 0 and gbps + _EPS < need.min_gbps:
            best = self.best_empty(topo, size)
            if best + _EPS < need.min_gbps:
                return (f"requires {_fmt(need.min_gbps)} all-reduce over {size} GPUs: this node's best is "
                        f"{_fmt(best)} even when empty", True)
            return (f"requires {_fmt(need.min_gbps)} all-reduce over {size} GPUs: the best free ones reach "
                    f"{_fmt(gbps)}", False)
        return None

    def _packing(self, topo: Topology, left_count: int, rings: list[tuple[int, float, float]]) -> float:
        loss = 0.0
        for s, before, after in rings:
            full_best = self.best_empty(topo, s)
            if full_best > 0:
                loss += s * (before - after) / full_best
        tight = 1.0 - left_count / topo.size
        # rounded once here, so equal packings compare equal in prioritize without rounding per node
        return round(0.85 * (1.0 - min(max(loss, 0.0), MAX_LOSS) / MAX_LOSS) + 0.15 * tight, PACKING_DIGITS)

    def shortfall(self, entry: NodeEntry, reserved: int, size: int) -> str:
        """'needs 4 GPUs, 2 free: GPU 0,1 in use, GPU 5 unhealthy'."""
        reserved &= entry.base_free
        return self._shortfall(entry.used_mask, entry.unhealthy_mask, reserved, entry.base_free & ~reserved, size)

    @staticmethod
    def _shortfall(used: int, unhealthy: int, reserved: int, free: int, size: int) -> str:
        parts = []
        if used:
            parts.append(f"GPU {gpu_list(used)} in use")
        bad = unhealthy & ~used
        if bad:
            parts.append(f"GPU {gpu_list(bad)} unhealthy")
        if reserved:
            parts.append(f"GPU {gpu_list(reserved)} reserved for pods being bound")
        return f"needs {size} GPU{'s' if size != 1 else ''}, {free.bit_count()} free" + (
            ": " + ", ".join(parts) if parts else "")

    def _fit_state(self, fingerprint: str, free: int, need: Need) -> Fit:
        key = (fingerprint, free, need_key(need))
        hit = self._fits.get(key)
        if hit is not None:
            return hit
        topo = self.cache.topologies[fingerprint]
        fit = self._compute(topo, free, need)
        if len(self._fits) >= _MEMO_LIMIT:
            self._fits.clear()
        self._fits[key] = fit
        return fit

    def _table(self, tables: dict[tuple[int, bool, float], dict[Any, Any]], need: Need) -> dict[Any, Any]:
        nk = need_key(need)
        table = tables.get(nk)
        if table is None or len(table) >= _MEMO_LIMIT:
            table = tables[nk] = {}
        return table

    def _states(self, names: list[str], extra: Mapping[str, NodeEntry] | None) -> list[PlacementState | None]:
        states: list[PlacementState | None] = list(map(self.cache.states.get, names))
        if extra and None in states:
            for i, st in enumerate(states):
                if st is None and names[i] in extra:
                    states[i] = self.cache.state_for(extra[names[i]], 0)
        return states

    # -- verbs ------------------------------------------------------------------------------------------------
    #
    # Both verbs map node names to node states, then states to answers through a per-need table, with C-level
    # map() calls: per node only a few dict lookups, and Python code runs only for states not seen before.

    def _verdict(self, st: PlacementState | None, need: Need) -> bool | Failed | Unresolvable:
        """True (passes), or the reason, typed by whether preemption could help."""
        if st is None:
            return Unresolvable(UNKNOWN_NODE)
        if st.problem is not None:
            return Unresolvable(st.problem)
        size, free = need.size, st.free
        if st.total < size:
            return Unresolvable(f"needs {size} GPUs, node has {st.total} in total")
        if free.bit_count() < size:
            return Failed(self._shortfall(st.used, st.unhealthy, st.reserved, free, size))
        if need.constrained:
            fit = self._fit_state(st.fingerprint, free, need)
            if fit.alloc is None:
                reason = fit.failure or "does not fit"
                return Unresolvable(reason) if fit.unresolvable else Failed(reason)
        return True

    def filter(self, names: Iterable[str], need: Need, extra: Mapping[str, NodeEntry] | None = None) -> FilterOutcome:
        names = list(names)
        if need.size == 0:
            return FilterOutcome(names, {}, {})
        states = self._states(names, extra)
        table = self._table(self._verdict_tables, need)
        verdicts = list(map(table.get, states))
        if None in verdicts:
            for i, v in enumerate(verdicts):
                if v is None:
                    v = verdicts[i] = self._verdict(states[i], need)
                    if states[i] is not None:
                        table[states[i]] = v
        if verdicts.count(True) == len(names):
            return FilterOutcome(names, {}, {})
        # split by the verdict's type with C-level iterators: no Python code per node
        kinds = list(map(type, verdicts))
        passed = list(compress(names, map(is_, kinds, repeat(bool))))
        failed_mask = list(map(is_, kinds, repeat(Failed)))
        unres_mask = list(map(is_, kinds, repeat(Unresolvable)))
        failed = dict(zip(compress(names, failed_mask), compress(verdicts, failed_mask), strict=True))
        unresolvable = dict(zip(compress(names, unres_mask), compress(verdicts, unres_mask), strict=True))
        return FilterOutcome(passed, failed, unresolvable)  # type: ignore[arg-type]

    def _score_fit(self, st: PlacementState | None, need: Need) -> Fit:
        if st is None or st.problem is not None or st.total < need.size or st.free.bit_count() < need.size:
            return NO_FIT
        fit = self._fit_state(st.fingerprint, st.free, need)
        return fit if fit.alloc is not None else NO_FIT

    def score(self, names: Iterable[str], need: Need, extra: Mapping[str, NodeEntry] | None = None) -> list[int]:
        """Scores 0-10 aligned with `names`."""
        names = list(names)
        if need.size == 0:
            return [0] * len(names)
        states = self._states(names, extra)
        table = self._table(self._score_tables, need)
        fits = list(map(table.get, states))
        if None in fits:
            for i, f in enumerate(fits):
                if f is None:
                    f = fits[i] = self._score_fit(states[i], need)
                    if states[i] is not None:
                        table[states[i]] = f
        # Nodes in equal states share one Fit object (hashed by identity): score the distinct ones, hand them out.
        counts = Counter(fits)
        counts.pop(NO_FIT, None)
        distinct = list(counts)
        config = self.cache.config
        values = island_values(counts, config.island_penalty, config.island_spare)
        scores = priority_scores([(v, f.packing) for f, v in zip(distinct, values, strict=True)])
        by_fit = dict(zip(distinct, scores, strict=True))
        by_fit[NO_FIT] = 0
        return list(map(by_fit.__getitem__, fits))

    def choose(self, entry: NodeEntry | None, free: int, need: Need) -> Allocation:
        """The subset bind commits to (same allocator, same free set as filter/prioritize saw). Raises NoFit."""
        if entry is None:
            raise NoFit(UNKNOWN_NODE, True)
        if entry.topo is None:
            raise NoFit(entry.problem or "publishes no GPU topology", True)
        if entry.total < need.size:
            raise NoFit(f"needs {need.size} GPUs, node has {entry.total} in total", True)
        if free.bit_count() < need.size:
            raise NoFit(self.shortfall(entry, entry.base_free & ~free, need.size))
        fit = self.fit(entry, free, need)
        if fit.alloc is None:
            raise NoFit(fit.failure or "does not fit", fit.unresolvable)
        return fit.alloc

    def efficiency(self, topo: Topology, alloc: Allocation) -> float:
        if len(alloc.gpus) <= 1:
            return 1.0
        best = self.best_empty(topo, len(alloc.gpus))
        return alloc.allreduce_gbps / best if best > 0 else 1.0

