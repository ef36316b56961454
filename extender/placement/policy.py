"""What makes one placement better than another: the best subset, its packing value and its island value.

Everything here is a function of (topology, free GPU set, pod need); extender.placement.memo remembers the answers
and extender.placement.engine asks the questions for each node.

Packing value of a choice (higher is better, in [0, 5]):
    loss  = sum over common sizes s in (2, 4, 8), s <= node size, of
            s * (best ring of s GPUs the free set can form - the same after taking the choice) / (best on empty node)
    tight = 1 - GPUs left free after the choice / node size
    packing = 2 x drain class + 0.85 * (1 - min(loss, 14) / 14) + 0.15 * tight
Drain class (with consolidate, else 0): 2 when at least half the node's GPUs were in use before the choice, 1 when
fewer, 0 when none (or, set by the engine, when an autoscaler marked the node as a removal candidate). Node
autoscalers remove a GPU node whose GPU requests stay under half its GPUs (the Cluster Autoscaler's default
threshold) and whose pods fit elsewhere, so among placements of equal value new pods go where GPUs are already busy
and lightly used nodes are left to empty. The class only orders nodes within one value band (scoring), so
bandwidth and the islands kept for larger pods still come first.
Loss is weighted by size because a large free island is rarer and more valuable than a small one: taking 1 GPU
from a whole free 8-GPU NVSwitch node loses the node's 8-GPU capability (loss 8), while taking the last free GPU of
another node loses nothing; taking 2 GPUs out of 3 free loses less than breaking a node's only free pair.

Value of a choice (what prioritize ranks nodes by, `island_values`):
    raw   = its all-reduce GB/s - island_penalty x (GB/s of the best rings of the larger common sizes it breaks
            where no other candidate node offers an equally fast free ring of that size)
    value = raw                      where raw >= level
            level^2 / (2 level - raw) below it (in (0, level), rising with raw, meeting raw at level)
    level = 1% of the smallest GB/s among the ranking's fits (`value_level`)
in absolute GB/s. While whole NVSwitch nodes are plentiful a 2-GPU pod takes the fastest pair; once the last one is
left, it prefers a node whose 8-GPU island is already broken, or a PCIe server whose 8-GPU ring was slow anyway,
keeping the island for the 8-GPU pod that needs it.
Values must stay positive (scoring.priority_scores bands nodes by value / best value, which means nothing once the
best is 0 or less), but the order must stay the raw one: a floor per fit (it was max(raw, 1% of its own GB/s))
made breaking the only 240 GB/s NVSwitch island (raw 240 - 240 = 0, floored to 2.4) tie with a 16.8 GB/s PCIe pair
breaking a 14.4 GB/s ring (raw 2.4), and even beat a PCIe pair whose raw value lay between 0 and 2.4. One map for
the whole ranking, the identity above `level`, keeps every distinct raw value distinct and in order. `level` lies at
or under every fit's old floor, so a ranking where no raw value was floored gets exactly the values it had.
Below the level the pod's own GB/s no longer pays for what it breaks, and there equal raw values still tie (the
NVSwitch pair, 240 - 240, and a DGX-1's, 40 - 40, at the demo's train-08). So within a band, where nodes are ordered
by packing, a fit below the level comes after those of equal packing above it, and among those below it the order
is by raw value, then by the scarce GB/s destroyed, least first (`standing`'s order key): of two equal choices, the
one that leaves the faster island whole ranks strictly higher when the band has room. Above the level the key is
the packing alone, as before.
A single GPU has no all-reduce GB/s to weigh against islands: its value is 0, as before (all single-GPU fits share
band 0 and packing decides, scoring's q = 1).

The core's allocator memoises best_subset and best_possible_gbps under its own lock, so these functions may be
called from any thread.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from extender.placement import reasons
from extender.placement.scoring import band_levels, band_of, priority_scores
from extender.state.pods import Need
from gputopo.contract import CA_GPU_UTILIZATION_THRESHOLD
from gputopo.core import Allocation, Topology, best_possible_gbps, best_subset, efficiency_ratio, min_nvlink_gbps
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
_EPS = 1e-9


@dataclass(frozen=True, slots=True, eq=False)  # identity: compared by the thousands on the hot path
class Fit:
    alloc: Allocation | None
    gbps: float
    packing: float
    failure: str | None = None
    unresolvable: bool = False
    # (size, best ring GB/s of the free set, the same after the choice) for each common size above the request
    islands: tuple[tuple[int, float, float], ...] = ()


NO_FIT = Fit(None, 0.0, 0.0, reasons.DOES_NOT_FIT)


class TopologyFacts:
    """What the empty node of one topology can do; shared by every node with its fingerprint."""

    __slots__ = ("_best_empty", "min_nvlink_gbps", "topo")

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.min_nvlink_gbps: float | None = min_nvlink_gbps(topo)  # the plugin's nvlink-ring labels use the same
        self._best_empty: dict[int, float] = {}  # filled lazily, per size

    def best_empty(self, size: int) -> float:
        """The best all-reduce GB/s of `size` GPUs on the empty node."""
        value = self._best_empty.get(size)
        if value is None:
            value = self._best_empty[size] = best_possible_gbps(self.topo, size)
        return value


def compute_fit(facts: TopologyFacts, free: int, need: Need, consolidate: bool = True) -> Fit:
    """Best subset of `free` for the need on a node of this topology, with its packing value, or why there is none."""
    topo = facts.topo
    size = need.size
    free_count = free.bit_count()
    if size > free_count:
        return Fit(None, 0.0, 0.0, reasons.too_few_free(size, free_count))
    alloc = best_subset(topo, bits(free), size)
    gbps = alloc.allreduce_gbps
    if need.constrained:
        problem = _constraint_problem(facts, alloc, need)
        if problem is not None:
            return Fit(None, gbps, 0.0, problem[0], problem[1])
    rings = _rings(topo, free, alloc)
    islands = tuple((s, before, after) for s, before, after in rings if s > size and s <= free_count)
    drain = drain_class(facts.topo.size - free_count, facts.topo.size) if consolidate else 0
    return Fit(alloc, gbps, 2 * drain + _packing(facts, free_count - size, rings), islands=islands)


def drain_class(in_use: int, size: int) -> int:
    """2: at least CA's threshold share of the node's GPUs in use; 1: some; 0: none (module docstring)."""
    if in_use <= 0:
        return 0
    return 2 if in_use >= CA_GPU_UTILIZATION_THRESHOLD * size else 1


def drain_of(fit: Fit) -> int:
    """The drain class a fit's packing carries."""
    return int(fit.packing // 2)


def draining(fit: Fit) -> Fit:
    """The fit as on a node an autoscaler marked as a removal candidate: drain class 0, same packing otherwise."""
    if fit.alloc is None or fit.packing < 2:
        return fit
    return replace(fit, packing=round(fit.packing - 2 * drain_of(fit), PACKING_DIGITS))


def _rings(topo: Topology, free: int, alloc: Allocation) -> list[tuple[int, float, float]]:
    """For each common size the node has: the best ring of that size its free GPUs form, before and after the
    choice (absolute GB/s). Packing weighs the loss relative to the node; island value weighs it absolutely
    (breaking an NVSwitch node's 8-GPU island costs more than a PCIe server's)."""
    left = free & ~mask_of(alloc.gpus)
    free_count, left_count = free.bit_count(), left.bit_count()
    out = []
    for s in COMMON_SIZES:
        if s > topo.size:
            break
        before = best_possible_gbps(topo, s, bits(free)) if free_count >= s else 0.0
        after = best_possible_gbps(topo, s, bits(left)) if left_count >= s else 0.0
        out.append((s, before, after))
    return out


def _constraint_problem(facts: TopologyFacts, alloc: Allocation, need: Need) -> tuple[str, bool] | None:
    """Why the best subset misses the pod's NVLink or bandwidth floor, and whether no eviction could change that."""
    size, gbps = need.size, alloc.allreduce_gbps
    if need.require_nvlink:
        floor = facts.min_nvlink_gbps
        if floor is None:
            return reasons.no_nvlink(facts.topo.fabric, size), True
        if gbps + _EPS < floor:
            best = facts.best_empty(size)
            if best + _EPS < floor:
                return reasons.no_nvlink_ring(size, best), True
            return reasons.nvlink_ring_taken(size, mask_of(alloc.gpus), gbps), False
    if need.min_gbps > 0 and gbps + _EPS < need.min_gbps:
        best = facts.best_empty(size)
        if best + _EPS < need.min_gbps:
            return reasons.too_slow_ever(need.min_gbps, size, best), True
        return reasons.too_slow_now(need.min_gbps, size, gbps), False
    return None


def _packing(facts: TopologyFacts, left_count: int, rings: list[tuple[int, float, float]]) -> float:
    loss = 0.0
    for s, before, after in rings:
        full_best = facts.best_empty(s)
        if full_best > 0:
            loss += s * (before - after) / full_best
    tight = 1.0 - left_count / facts.topo.size
    # rounded once here, so equal packings compare equal in prioritize without rounding per node
    return round(0.85 * (1.0 - min(max(loss, 0.0), MAX_LOSS) / MAX_LOSS) + 0.15 * tight, PACKING_DIGITS)


def island_supply(counts: Mapping[Fit, int]) -> dict[int, dict[float, int]]:
    """Per larger size: how many candidate nodes offer a free ring of each GB/s (counts: nodes per state)."""
    supply: dict[int, dict[float, int]] = {}
    for f, n in counts.items():
        for s, before, _after in f.islands:
            at = supply.setdefault(s, {})
            at[before] = at.get(before, 0) + n
    return supply


def scarcity_cut(offered: Mapping[float, int], spare: int) -> float:
    """The first GB/s, from the fastest down, at which more than `spare` candidate nodes offer an island of one
    size (`offered`: nodes per GB/s); -inf when no GB/s is offered that often. An island is scarce exactly when its
    GB/s less eps lies above the cut: fewer than `spare` other candidates (nodes in its state count) offer one at
    least as fast."""
    total = 0
    for before in sorted(offered, reverse=True):
        total += offered[before]
        if total > spare:
            return before
    return float("-inf")


def scarce_loss(f: Fit, cuts: Mapping[int, float]) -> float:
    """The GB/s of every larger island it breaks that is scarce (scarcity_cut)."""
    loss = 0.0
    for s, before, after in f.islands:
        if cuts[s] < before - _EPS and before > after:
            loss += before - after
    return loss


def raw_value(f: Fit, cuts: Mapping[int, float], penalty: float) -> float:
    """Its GB/s, less `penalty` x scarce_loss; may be 0 or less (island_value maps it to what prioritize ranks)."""
    return f.gbps - penalty * scarce_loss(f, cuts)


def value_level(gbps: Iterable[float]) -> float:
    """The level under which island_value compresses raw values into (0, level): VALUE_FLOOR x the smallest
    positive GB/s among a ranking's fits, so it lies at or under each fit's own VALUE_FLOOR x GB/s (where a raw
    value is not small for its fit, it is left as it is); 0 when no fit has GB/s (single GPUs)."""
    return VALUE_FLOOR * min((g for g in gbps if g > 0), default=0.0)


def island_value(f: Fit, cuts: Mapping[int, float], penalty: float, level: float) -> float:
    """What prioritize ranks the fit by: its raw_value where that is at least `level` (value_level of the ranking),
    else level^2 / (2 level - raw), positive and strictly rising with the raw value, so a choice whose GB/s pays less
    for the scarce islands it breaks never ties with, or beats, one that pays more (module docstring). A single GPU
    (no GB/s) is worth 0, whatever it breaks: packing alone ranks those."""
    return standing(f, cuts, penalty, level)[0]


# (packing, then for a fit valued below the level: its raw value and less the scarce GB/s it destroys)
OrderKey = tuple[float, float, float]
_ABOVE = (float("inf"), 0.0)


def standing(f: Fit, cuts: Mapping[int, float], penalty: float, level: float) -> tuple[float, OrderKey]:
    """(island_value, order_key): what prioritize bands the fit by, and what orders it within its band."""
    if f.gbps <= 0:
        return 0.0, (f.packing, *_ABOVE)
    loss = scarce_loss(f, cuts)
    raw = f.gbps - penalty * loss
    if raw >= level:
        return raw, (f.packing, *_ABOVE)
    # rounded, so float noise in sums of GB/s does not split equal choices
    return level * level / (2 * level - raw), (f.packing, round(raw, PACKING_DIGITS), -round(loss, PACKING_DIGITS))


def island_values(counts: Mapping[Fit, int], penalty: float, spare: int) -> list[float]:
    """Each distinct fit's island_value. Breaking one of many equal islands costs nothing (a lightly loaded cluster
    stays greedy); breaking one of the last few is paid for."""
    return [v for v, _ in standings(counts, penalty, spare)]


def standings(counts: Mapping[Fit, int], penalty: float, spare: int) -> list[tuple[float, OrderKey]]:
    """Each distinct fit's standing: its island_value and its order key within a band."""
    cuts = {s: scarcity_cut(at, spare) for s, at in island_supply(counts).items()}
    level = value_level(f.gbps for f in counts)
    return [standing(f, cuts, penalty, level) for f in counts]


def scarce_islands(counts: Mapping[Fit, int], fit: Fit, spare: int) -> list[tuple[int, float, float]]:
    """(size, GB/s before, after) of the scarce islands `fit` would break, whole or not (island_value charges
    those it breaks)."""
    cuts = {s: scarcity_cut(at, spare) for s, at in island_supply(counts).items()}
    return [(s, before, after) for s, before, after in fit.islands if cuts[s] < before - _EPS]


@dataclass(frozen=True, slots=True)
class Ranking:
    """One prioritize call's scores, aligned with its fits, and per distinct fit (NO_FIT scores 0) with how many
    nodes share it: what extender.placement.explain reads to word the choice without walking the nodes again."""

    scores: list[int]
    by_fit: dict[Fit, int]
    counts: Counter[Fit]


def rank(fits: Sequence[Fit], penalty: float, spare: int) -> Ranking:
    """Scores 0-10 aligned with `fits`. Nodes in equal states share one Fit object (hashed by identity): only the
    distinct ones are valued, then the scores are handed out."""
    counts = Counter(fits)
    counts.pop(NO_FIT, None)
    distinct = list(counts)
    scores = priority_scores(standings(counts, penalty, spare))
    by_fit = dict(zip(distinct, scores, strict=True))
    by_fit[NO_FIT] = 0
    return Ranking(list(map(by_fit.__getitem__, fits)), by_fit, counts)


class Ranker:
    """rank() for one need, request after request, from what changed since its last call (issue 24: kube-scheduler
    sends prioritize after each filter, the passed list a few nodes apart from the last one, and valuing each of
    ~750 distinct states from scratch was most of a prepared prioritize at 5,000 nodes). Equal to rank() always.

    A state's island value depends on the others only through one cut per larger size (scarcity_cut) and the
    ranking's value_level. The cuts are kept from per-size node counts (island_supply's), the level from the
    distinct states' GB/s, both updated by the states that came or went; while none moves, only new states are
    valued. Likewise the scores: while the best value and each band's set of order keys (standing's: the packing,
    and below the value level what the fit breaks) stay, only new states get a score. `lock` keeps one caller at a
    time (others call rank())."""

    def __init__(self, penalty: float, spare: int) -> None:
        self.penalty, self.spare = penalty, spare
        self.lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._counts: Counter[Fit] = Counter()
        self._supply: dict[int, dict[float, int]] = {}
        self._cut: dict[int, float] = {}
        self._gbps: Counter[float] = Counter()  # distinct states per GB/s, for value_level
        self._level = 0.0
        self._values: dict[Fit, tuple[float, OrderKey]] = {}  # standing(): value, order key
        self._best = 0.0
        self._bands: dict[Fit, tuple[int, OrderKey]] = {}  # band, order key
        self._keys: list[Counter[OrderKey]] = [Counter(), Counter(), Counter()]
        self._levels: list[dict[OrderKey, int]] = [{}, {}, {}]
        self._scores: dict[Fit, int] = {NO_FIT: 0}

    def rank(self, fits: Sequence[Fit]) -> Ranking:
        counts = Counter(fits)
        counts.pop(NO_FIT, None)
        try:
            if counts != self._counts:
                self._update(counts)
        except BaseException:
            self._reset()
            raise
        scores = self._scores
        return Ranking(list(map(scores.__getitem__, fits)), dict(scores), counts)

    def _update(self, counts: Counter[Fit]) -> None:
        old = self._counts
        changed = {f for f, _ in counts.items() ^ old.items()}
        touched: set[int] = set()
        supply, gbps = self._supply, self._gbps
        for f in changed:
            d = counts.get(f, 0) - old.get(f, 0)
            if f not in old:
                gbps[f.gbps] += 1
            elif f not in counts:
                gbps[f.gbps] -= 1
                if not gbps[f.gbps]:
                    del gbps[f.gbps]
            for s, before, _after in f.islands:
                at = supply.setdefault(s, {})
                n = at.get(before, 0) + d
                if n:
                    at[before] = n
                else:
                    del at[before]
                touched.add(s)
        moved = False
        for s in touched:
            cut = scarcity_cut(supply[s], self.spare)
            if not supply[s]:
                del supply[s]
            if self._cut.get(s) != cut:
                moved = True
                self._cut[s] = cut
        level = value_level(gbps)
        if level != self._level:
            moved = True
            self._level = level
        self._counts = counts
        values = self._values
        if moved:
            values = self._values = {f: standing(f, self._cut, self.penalty, level) for f in counts}
        else:
            for f in changed:
                if f not in counts:
                    values.pop(f, None)
                elif f not in values:
                    values[f] = standing(f, self._cut, self.penalty, level)
        best = max((v for v, _ in values.values()), default=0.0)
        if moved or best != self._best or not self._patch_scores(changed, counts):
            self._score_all(best)

    def _patch_scores(self, changed: set[Fit], counts: Counter[Fit]) -> bool:
        """Scores for the states that came, drop those that went; False when a band's order keys changed (then
        every level may move)."""
        bands, keys, scores, values = self._bands, self._keys, self._scores, self._values
        had = [set(k) for k in keys]
        for f in changed:
            if f in counts:
                if f not in bands:
                    value, key = values[f]
                    b = band_of(value, self._best)
                    bands[f] = b, key
                    keys[b][key] += 1
            elif f in bands:
                b, key = bands.pop(f)
                scores.pop(f, None)
                keys[b][key] -= 1
                if not keys[b][key]:
                    del keys[b][key]
        if any(had[b] != keys[b].keys() for b in range(3)):
            return False
        for f in changed:
            if f in counts and f not in scores:
                b, key = bands[f]
                scores[f] = self._levels[b][key]
        return True

    def _score_all(self, best: float) -> None:
        self._best = best
        bands = self._bands = {f: (band_of(v, best), key) for f, (v, key) in self._values.items()}
        keys: list[Counter[OrderKey]] = [Counter(), Counter(), Counter()]
        for b, key in bands.values():
            keys[b][key] += 1
        self._keys = keys
        levels = self._levels = [band_levels(b, k) for b, k in enumerate(keys)]
        scores = self._scores = {f: levels[b][key] for f, (b, key) in bands.items()}
        scores[NO_FIT] = 0


def efficiency(facts: TopologyFacts, alloc: Allocation) -> float:
    """A plan's efficiency vs the empty node (gputopo.core.efficiency), from the memoised best of its size."""
    size = len(alloc.gpus)
    return efficiency_ratio(alloc.allreduce_gbps, facts.best_empty(size) if size > 1 else 0.0, size)
