"""The allocator: the best `size` GPUs out of `available`, by the lexicographic score of DESIGN.md.

Score, higher is better: (1) ring bottleneck (estimated all-reduce GB/s), (2) total pairwise bandwidth, (3) fewer
NUMA nodes spanned, (4) remainder quality: how well the GPUs left free can still serve the common request sizes
(2, 4, 8), each measured as the best ring the remainder can form relative to the empty node's best. Remaining ties go
to the lexicographically smallest index tuple, so the answer is deterministic.

Up to EXACT_LIMIT GPUs the search is exact: every candidate subset is scored at once with numpy on components (2)
and (3) and an upper bound on (1) (a ring uses two links at each GPU, so its bottleneck is at most every GPU's
second-best link); the exact ring check then runs only on candidates that could still win, from the highest
bandwidth threshold down. Beyond that a greedy construction plus swap search runs within a time budget and reports
how close it is to an upper bound.

Results are memoised on (topology fingerprint, free set, must-include set, size): a scheduler scoring thousands of
nodes that share a few topologies pays for each distinct question once.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from gputopo.core.bitset import bits as _bits
from gputopo.core.bitset import mask_of as _mask
from gputopo.core.errors import AllocationError
from gputopo.core.scoring import (
    SearchLimitExceeded,
    numa_span,
    ring_at_least,
    ring_bottleneck_mbps,
    total_mbps,
)
from gputopo.core.topology import Topology

EXACT_LIMIT = 16
COMMON_SIZES = (2, 4, 8)
LARGE_TIME_BUDGET_S = 0.05
_QUALITY_UNIT = 1_000_000
_MEMO_LIMIT = 200_000
_CONTEXT_LIMIT = 512


@dataclass(frozen=True)
class Allocation:
    """The chosen GPUs (sorted indices) and each score component, so callers can explain the choice."""

    gpus: tuple[int, ...]
    allreduce_gbps: float
    total_gbps: float
    numa_nodes: int
    remainder_quality: float
    optimal: bool
    bound_gbps: float

    @property
    def score(self) -> tuple[float, float, int, float]:
        return (self.allreduce_gbps, self.total_gbps, -self.numa_nodes, self.remainder_quality)


@dataclass
class _Context:
    """Per-topology tables and memos, shared by every topology object with the same fingerprint."""

    n: int
    bw: tuple[tuple[int, ...], ...]
    bw_np: np.ndarray
    numa: tuple[int, ...]
    numa_np: np.ndarray
    thresholds: tuple[int, ...]
    # Per threshold t (same order as `thresholds`): adjacency bitmask of each GPU over links >= t, and the
    # connected-component id of each GPU in that graph. A subset can hold a ring at t only if every member has two
    # neighbours inside it and all members share one component: two cheap, vectorised filters before the exact search.
    adj_np: tuple[np.ndarray, ...] = ()
    comp_np: tuple[np.ndarray, ...] = ()
    max_ring_memo: dict[tuple[int, int], int] = field(default_factory=dict)
    results: OrderedDict[tuple[frozenset[int], frozenset[int], int], Allocation] = field(default_factory=OrderedDict)


_CONTEXTS: OrderedDict[str, _Context] = OrderedDict()
_LOCK = threading.RLock()


def _context(topo: Topology) -> _Context:
    ctx = _CONTEXTS.get(topo.fingerprint)
    if ctx is not None:
        _CONTEXTS.move_to_end(topo.fingerprint)
        return ctx
    n = topo.size
    # Unknown NUMA (None) becomes one shared code, so it neither helps nor hurts a subset.
    codes: dict[int | None, int] = {}
    numa = tuple(codes.setdefault(g.numa_node, len(codes)) for g in topo.gpus)
    values = {topo.bandwidth_mbps[i][j] for i in range(n) for j in range(n) if i != j}
    thresholds = tuple(sorted(values, reverse=True))
    adj_np, comp_np = [], []
    for t in thresholds if n <= EXACT_LIMIT else ():
        adj = [_mask(j for j in range(n) if j != i and topo.bandwidth_mbps[i][j] >= t) for i in range(n)]
        comp = [-1] * n
        for start in range(n):
            if comp[start] < 0:
                stack = [start]
                comp[start] = start
                while stack:
                    v = stack.pop()
                    for u in _bits(adj[v]):
                        if comp[u] < 0:
                            comp[u] = start
                            stack.append(u)
        adj_np.append(np.array(adj, dtype=np.int64))
        comp_np.append(np.array(comp, dtype=np.int64))
    ctx = _Context(
        n=n,
        bw=topo.bandwidth_mbps,
        bw_np=np.array(topo.bandwidth_mbps, dtype=np.int64),
        numa=numa,
        numa_np=np.array(numa, dtype=np.int64),
        thresholds=thresholds,
        adj_np=tuple(adj_np),
        comp_np=tuple(comp_np),
    )
    _CONTEXTS[topo.fingerprint] = ctx
    if len(_CONTEXTS) > _CONTEXT_LIMIT:
        _CONTEXTS.popitem(last=False)
    return ctx


def clear_memo() -> None:
    """Forget every memoised answer (benchmarks use it to measure cold calls)."""
    with _LOCK:
        _CONTEXTS.clear()


@lru_cache(maxsize=512)
def _combos(m: int, r: int) -> np.ndarray:
    if r == 0:
        return np.zeros((1, 0), dtype=np.int64)
    return np.array(list(itertools.combinations(range(m), r)), dtype=np.int64).reshape(-1, r)


def _index_set(values: Iterable[int], n: int, what: str) -> frozenset[int]:
    items = list(values)
    if not all(type(v) is int for v in items):
        for v in items:
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise AllocationError(f"{what} holds {v!r}, not a GPU index")
        items = [int(v) for v in items]
    result = frozenset(items)
    if len(result) != len(items):
        dup = sorted({v for v in items if items.count(v) > 1})
        raise AllocationError(f"{what} lists GPU {dup[0]} twice")
    if result and (min(result) < 0 or max(result) >= n):
        bad = next(v for v in sorted(result) if not 0 <= v < n)
        raise AllocationError(f"{what} holds GPU index {bad}, outside 0..{n - 1}")
    return result


def _validate(
    topo: Topology, available: Iterable[int], size: int, must_include: Iterable[int]
) -> tuple[frozenset[int], frozenset[int]]:
    if isinstance(size, bool) or not isinstance(size, int):
        raise AllocationError(f"size must be an integer, got {size!r}")
    if size <= 0:
        raise AllocationError(f"size must be positive, got {size}")
    avail = _index_set(available, topo.size, "available")
    must = _index_set(must_include, topo.size, "must_include")
    if not must <= avail:
        raise AllocationError(f"must_include GPUs {sorted(must - avail)} are not available")
    if len(must) > size:
        raise AllocationError(f"must_include has {len(must)} GPUs, more than the size {size}")
    if size > len(avail):
        raise AllocationError(f"size {size} exceeds the {len(avail)} available GPUs")
    return avail, must


def best_subset(
    topology: Topology, available: Iterable[int], size: int, must_include: Iterable[int] = ()
) -> Allocation:
    """The best `size` GPUs out of `available` that contain `must_include` (all as GPU indices)."""
    avail_set, must_set = _validate(topology, available, size, must_include)
    key = (avail_set, must_set, size)
    # One lock over the memo tables: the plugin's prewarm thread, gRPC workers and the extender's bind threads
    # share them (a pure function, but its caches are shared state).
    with _LOCK:
        ctx = _context(topology)
        hit = ctx.results.get(key)
        if hit is not None:
            ctx.results.move_to_end(key)
            return hit
        avail, must = _mask(avail_set), _mask(must_set)
        if ctx.n <= EXACT_LIMIT:
            result = _exact(ctx, avail, must, size)
        else:
            result = _large(ctx, avail, must, size)
        ctx.results[key] = result
        if len(ctx.results) > _MEMO_LIMIT:
            ctx.results.popitem(last=False)
        return result


def _max_ring(ctx: _Context, mask: int, s: int) -> int:
    """The best ring bottleneck any s GPUs of `mask` can form (component 1 alone)."""
    key = (mask, s)
    hit = ctx.max_ring_memo.get(key)
    if hit is not None:
        return hit
    members = _bits(mask)
    if s <= 1 or len(members) < s:
        value = 0
    elif s == 2:
        value = max(ctx.bw[a][b] for i, a in enumerate(members) for b in members[i + 1 :])
    elif ctx.n > EXACT_LIMIT:
        value = _greedy_ring(ctx, members, [], s)[0]
    else:
        mem = np.array(members, dtype=np.int64)[_combos(len(members), s)]
        rowmask = np.bitwise_or.reduce(np.left_shift(1, mem), axis=1)
        full = (1 << ctx.n) - 1
        cap = _max_ring(ctx, full, s) if mask != full else ctx.thresholds[0]
        value = 0
        for t_idx, t in enumerate(ctx.thresholds):
            if t > cap:
                continue
            rows = np.nonzero(_ring_candidates(ctx, mem, rowmask, t_idx))[0]
            if any(ring_at_least(ctx.bw, mem[r].tolist(), t) for r in rows):
                value = t
                break
    ctx.max_ring_memo[key] = value
    return value


def _ring_candidates(ctx: _Context, mem: np.ndarray, rowmask: np.ndarray, t_idx: int) -> np.ndarray:
    """Rows of `mem` that pass both necessary conditions for a ring at threshold index t_idx."""
    nbrs = ctx.adj_np[t_idx][mem] & rowmask[:, None]
    ok = (np.bitwise_count(nbrs) >= 2).all(axis=1)
    comp = ctx.comp_np[t_idx][mem]
    return ok & (comp == comp[:, :1]).all(axis=1)


def _remainder_quality(ctx: _Context, remainder: int) -> int:
    return _quality(ctx, remainder, remainder.bit_count())


def _quality(ctx: _Context, pool: int, left: int) -> int:
    """Sum over the common sizes up to `left` of the best ring the GPUs of `pool` can form, relative to the empty
    node's best: component (4) of the score for a remainder (pool = the remainder), or its ceiling (pool = the
    whole free set, which no remainder of it can beat)."""
    full = (1 << ctx.n) - 1
    q = 0
    for s in COMMON_SIZES:
        if s > left:
            break
        best = _max_ring(ctx, full, s)
        if best:
            q += _max_ring(ctx, pool, s) * _QUALITY_UNIT // best
    return q


def _allocation(
    ctx: _Context, gpus: list[int], quality: int, optimal: bool, bound: int, ring: int | None = None
) -> Allocation:
    gpus = sorted(gpus)
    return Allocation(
        gpus=tuple(gpus),
        allreduce_gbps=(ring_bottleneck_mbps(ctx.bw, gpus) if ring is None else ring) / 1000.0,
        total_gbps=total_mbps(ctx.bw, gpus) / 1000.0,
        numa_nodes=numa_span(ctx.numa, gpus),
        remainder_quality=quality / _QUALITY_UNIT,
        optimal=optimal,
        bound_gbps=bound / 1000.0,
    )


def _exact(ctx: _Context, avail: int, must: int, size: int) -> Allocation:
    must_list = _bits(must)
    free_list = _bits(avail & ~must)
    r = size - len(must_list)
    if r == 0 or r == len(free_list):
        chosen = must_list + (free_list if r else [])
        b = ring_bottleneck_mbps(ctx.bw, chosen)
        return _allocation(ctx, chosen, _remainder_quality(ctx, avail & ~_mask(chosen)), True, b)

    combos = _combos(len(free_list), r)
    mem = np.array(free_list, dtype=np.int64)[combos]
    if must_list:
        mem = np.concatenate([np.broadcast_to(np.array(must_list, dtype=np.int64), (len(mem), len(must_list))), mem], 1)
    sub = ctx.bw_np[mem[:, :, None], mem[:, None, :]]
    total = sub.sum(axis=(1, 2)) // 2
    numa_sorted = np.sort(ctx.numa_np[mem], axis=1)
    span = 1 + (np.diff(numa_sorted, axis=1) != 0).sum(axis=1)

    if size <= 2:
        bott = np.zeros(len(mem), dtype=np.int64) if size == 1 else sub[:, 0, 1]
        best_b = int(bott.max())
        cand = np.nonzero(bott == best_b)[0]
        order = cand[np.lexsort((cand, span[cand], -total[cand]))]
        ties = order[(total[order] == total[order[0]]) & (span[order] == span[order[0]])]
        passes = None
    else:
        # From the highest threshold down: the first row (in score order) holding a ring at t decides t; its
        # group of equal (total, span) rows is contiguous in that order. Ring checks on the rest stay lazy.
        rowmask = np.bitwise_or.reduce(np.left_shift(1, mem), axis=1)
        best_b, ties = 0, None
        for t_idx, t in enumerate(ctx.thresholds):
            cand = np.nonzero(_ring_candidates(ctx, mem, rowmask, t_idx))[0]
            if not len(cand):
                continue
            order = cand[np.lexsort((cand, span[cand], -total[cand]))]
            for pos, j in enumerate(order):
                if ring_at_least(ctx.bw, mem[j].tolist(), t):
                    rest = order[pos:]
                    ties = rest[(total[rest] == total[j]) & (span[rest] == span[j])]
                    break
            if ties is not None:
                best_b = t
                break
        assert ties is not None  # at the lowest threshold every GPU pair qualifies
        passes = best_b

    if len(ties) == 1:
        chosen = mem[ties[0]].tolist()
        return _allocation(ctx, chosen, _remainder_quality(ctx, avail & ~_mask(chosen)), True, best_b, best_b)

    # Component (4) on the ties, in lexicographic order; stop once one reaches what any remainder could reach.
    ceiling: int | None = None
    best_q, best_row = -1, int(ties[0])
    for n_tie, j in enumerate(ties):
        chosen = mem[j].tolist()
        if passes is not None and n_tie and not ring_at_least(ctx.bw, chosen, passes):
            continue
        q = _remainder_quality(ctx, avail & ~_mask(chosen))
        if q > best_q:
            best_q, best_row = q, int(j)
            if ceiling is None:
                ceiling = _remainder_quality_ceiling(ctx, avail, size, tight=q < _loose_ceiling(avail, size))
            if q >= ceiling:
                break
    return _allocation(ctx, mem[best_row].tolist(), best_q, True, best_b, best_b)


def _loose_ceiling(avail: int, size: int) -> int:
    left = avail.bit_count() - size
    return sum(_QUALITY_UNIT for s in COMMON_SIZES if s <= left)


def _remainder_quality_ceiling(ctx: _Context, avail: int, size: int, tight: bool = True) -> int:
    """No remainder of `avail` can beat the free set itself at any size (nor the empty node: the loose form)."""
    if not tight:
        return _loose_ceiling(avail, size)
    return _quality(ctx, avail, avail.bit_count() - size)


# ---- beyond EXACT_LIMIT: greedy construction and swap search within a time budget ----


def _ring_bound(ctx: _Context, members: list[int], must: list[int], s: int) -> int:
    """Upper bound on the best ring of size s: the largest threshold at which some connected part of the free
    graph holding every must-include GPU keeps s GPUs with at least two links (its 2-core)."""
    if s == 2:
        if must:
            if len(must) == 2:
                return ctx.bw[must[0]][must[1]]
            return max(ctx.bw[must[0]][b] for b in members if b != must[0])
        return max(ctx.bw[a][b] for i, a in enumerate(members) for b in members[i + 1 :])
    mset = set(members)
    for t in ctx.thresholds:
        alive = set(mset)
        changed = True
        while changed:
            changed = False
            for v in list(alive):
                if sum(1 for u in alive if u != v and ctx.bw[v][u] >= t) < 2:
                    alive.discard(v)
                    changed = True
        for comp in _components(ctx, alive, t):
            if len(comp) >= s and all(m in comp for m in must):
                return t
    return ctx.thresholds[-1]


def _components(ctx: _Context, nodes: set[int], t: int) -> list[set[int]]:
    seen: set[int] = set()
    comps = []
    for start in nodes:
        if start in seen:
            continue
        comp, stack = {start}, [start]
        seen.add(start)
        while stack:
            v = stack.pop()
            for u in nodes:
                if u not in seen and ctx.bw[v][u] >= t:
                    seen.add(u)
                    comp.add(u)
                    stack.append(u)
        comps.append(comp)
    return comps


def _greedy_ring(ctx: _Context, members: list[int], must: list[int], s: int) -> tuple[int, list[int]]:
    """Best ring bottleneck found greedily for s GPUs of `members` containing `must`, and the GPUs."""
    bound = _ring_bound(ctx, members, must, s)
    for t in ctx.thresholds:
        if t > bound:
            continue
        by_degree = sorted(members, key=lambda v: -sum(ctx.bw[v][u] >= t for u in members))
        seeds = [must] if must else [[v] for v in by_degree[:8]]
        for seed in seeds:
            chosen = _grow(ctx, members, list(seed), s, t)
            if chosen is None:
                continue
            try:
                ok = ring_at_least(ctx.bw, chosen, t, step_limit=20_000)
            except SearchLimitExceeded:
                ok = False
            if ok:
                return t, chosen
    chosen = _grow(ctx, members, list(must) or [members[0]], s, 0) or members[:s]
    return ring_bottleneck_mbps(ctx.bw, chosen), chosen


def _grow(ctx: _Context, members: list[int], chosen: list[int], s: int, t: int) -> list[int] | None:
    numa_first = ctx.numa[chosen[0]]
    pool = [v for v in members if v not in chosen]
    while len(chosen) < s:
        best, best_key = None, None
        for v in pool:
            links = [ctx.bw[v][u] for u in chosen]
            strong = sum(1 for x in links if x >= t)
            if t and strong == 0:
                continue
            key = (strong, ctx.numa[v] == numa_first, sum(links), -v)
            if best_key is None or key > best_key:
                best, best_key = v, key
        if best is None:
            return None
        chosen.append(best)
        pool.remove(best)
    return chosen


def _large(ctx: _Context, avail: int, must: int, size: int) -> Allocation:
    deadline = time.perf_counter() + LARGE_TIME_BUDGET_S
    members, must_list = _bits(avail), _bits(must)
    if size == avail.bit_count() or size == len(must_list):
        chosen = members if size == avail.bit_count() else must_list
        quality = _remainder_quality(ctx, avail & ~_mask(chosen))
        return _allocation(ctx, chosen, quality, True, ring_bottleneck_mbps(ctx.bw, chosen))
    bound = _ring_bound(ctx, members, must_list, size) if size >= 2 else 0
    if size == 1:
        best = min(members, key=lambda v: (-_remainder_quality(ctx, avail & ~(1 << v)), v))
        return _allocation(ctx, [best], _remainder_quality(ctx, avail & ~(1 << best)), False, 0)
    b, chosen = _greedy_ring(ctx, members, must_list, size)

    def key(sel: list[int]) -> tuple[int, int, int]:
        return (b, total_mbps(ctx.bw, sel), -numa_span(ctx.numa, sel))

    # Swap search on components (2) and (3) while keeping the ring at least b.
    current = key(chosen)
    improved = True
    while improved and time.perf_counter() < deadline:
        improved = False
        outside = [v for v in members if v not in chosen]
        for pos, out_v in enumerate(chosen):
            if out_v in must_list or time.perf_counter() >= deadline:
                continue
            for in_v in outside:
                cand = [*chosen[:pos], in_v, *chosen[pos + 1 :]]
                k = key(cand)
                if k <= current:
                    continue
                try:
                    if not ring_at_least(ctx.bw, cand, b, step_limit=5_000):
                        continue
                except SearchLimitExceeded:
                    continue
                chosen, current, improved = cand, k, True
                break
            if improved:
                break
    quality = _remainder_quality(ctx, avail & ~_mask(chosen))
    return _allocation(ctx, chosen, quality, False, bound)


def remainder_quality(topology: Topology, remainder: Iterable[int]) -> float:
    """Component (4) of the score for GPUs left free, as `Allocation.remainder_quality` reports it: rankings of
    many candidate subsets (gputopo.core.ranking) need it without running a search per candidate."""
    with _LOCK:
        ctx = _context(topology)
        return _remainder_quality(ctx, _mask(_index_set(remainder, ctx.n, "remainder"))) / _QUALITY_UNIT


def allreduce_gbps(topology: Topology, gpus: Iterable[int]) -> float:
    """Estimated all-reduce GB/s of a given subset (its best ring's bottleneck); 0.0 for a single GPU."""
    return ring_bottleneck_mbps(topology.bandwidth_mbps, list(gpus)) / 1000.0


def best_possible_gbps(topology: Topology, size: int, available: Iterable[int] | None = None) -> float:
    """The best ring any `size` GPUs of `available` (default: the empty node) can form."""
    with _LOCK:
        ctx = _context(topology)
        mask = (1 << ctx.n) - 1 if available is None else _mask(available)
        return _max_ring(ctx, mask, size) / 1000.0


def min_nvlink_gbps(topology: Topology) -> float | None:
    """The slowest NVLink pair's GB/s (None without NVLink): a ring whose bottleneck reaches it runs on NVLink alone,
    which is what `require-nvlink` asks of a pod's GPUs."""
    n = topology.size
    nv = [topology.gbps(i, j) for i in range(n) for j in range(i + 1, n) if topology.link(i, j).kind.is_nvlink]
    return min(nv) if nv else None


def nvlink_ring_sizes(topology: Topology) -> frozenset[int]:
    """The sizes k (2..GPU count) for which the empty node has k GPUs whose best ring meets `min_nvlink_gbps`. Not
    always every size up to the largest: GPUs linked in a square have an NVLink ring of 2 and of 4, none of 3."""
    floor = min_nvlink_gbps(topology)
    if floor is None:
        return frozenset()
    return frozenset(k for k in range(2, topology.size + 1) if best_possible_gbps(topology, k) + 1e-9 >= floor)
