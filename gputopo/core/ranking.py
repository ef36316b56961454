"""Ranking GPU sets and ordering single GPUs for consumers that take the first free choice in a published list.

The Kubernetes DRA allocator is such a consumer: it takes the first device in published order whose GPUs are all
free, and for a request of N single GPUs the first N free ones. So the quality of what it hands out is decided by
the order we publish, and this module decides that order with the allocator's own score (DESIGN.md):

- `SetRanker.rank(free, sets)`: candidate sets best first by (ring bottleneck, total bandwidth, fewer NUMA nodes,
  quality of what the set leaves free), then lexicographically. Its first element is `best_subset(free, k)` on
  the same free set, by construction of the same score (tests prove it against the allocator and exhaustive search).
- `SetRanker.single_order(free)`: the free GPUs in an order whose prefixes form good rings: the prefix of the
  largest power of two P <= |free| is the best P-set of `free`, and each smaller power-of-two prefix is the best
  set of that size inside the next larger one (a nested chain: one order cannot make every prefix optimal).
  For a request of N singles at once (`nvidia.com/gpu: N`).
- `SetRanker.one_at_a_time_order(free)`: the free GPUs in the order successive 1-GPU requests should take them:
  each is `best_subset(left, 1)` of the GPUs still left, so a lone GPU goes first where it breaks no block (an
  orphan) and the best blocks stay whole for the multi-GPU requests. `single_order` cannot serve both consumers:
  its first GPU lies inside the best free block by construction, so 1-GPU requests taking it break that block.
- `SetRanker.select(size, limit)`: which `limit` sets of one size to offer when all of them are too many: best
  first by the static part of the score, with every GPU's share capped so that losing one GPU does not take out
  most of the offer.

Only the remainder component depends on the free set; the rest of a set's score is computed once per set.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence

from gputopo.core.allocator import best_subset, remainder_quality
from gputopo.core.bitset import mask_of
from gputopo.core.errors import AllocationError
from gputopo.core.scoring import numa_span, ring_bottleneck_mbps, total_mbps
from gputopo.core.topology import Topology

GpuSet = tuple[int, ...]
StaticKey = tuple[int, int, int]  # (ring bottleneck MB/s, total MB/s, -NUMA nodes spanned): higher is better


class SetRanker:
    """Ranks sets of one topology; caches the free-set-independent part of each set's score."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self._numa = tuple(g.numa_node for g in topology.gpus)
        self._static: dict[GpuSet, StaticKey] = {}

    def static_key(self, gpus: Iterable[int]) -> StaticKey:
        """Components (1)-(3) of the score; they do not depend on which other GPUs are free."""
        members = tuple(sorted(gpus))
        key = self._static.get(members)
        if key is None:
            bw = self.topology.bandwidth_mbps
            key = (ring_bottleneck_mbps(bw, members), total_mbps(bw, members), -numa_span(self._numa, members))
            self._static[members] = key
        return key

    def rank(self, free: Iterable[int], sets: Iterable[Iterable[int]]) -> list[GpuSet]:
        """`sets` (each inside `free`) best first for a request of their size on a node whose free GPUs are
        `free`. Component (4) is computed only where components (1)-(3) tie."""
        free_set = frozenset(free)
        free_mask = mask_of(free_set)
        items = []
        for s in sets:
            members = tuple(sorted(s))
            if mask_of(members) & ~free_mask:
                raise AllocationError(f"set {list(members)} is not inside the free GPUs {sorted(free_set)}")
            items.append((self.static_key(members), members))
        items.sort(key=lambda item: (tuple(-x for x in item[0]), item[1]))
        out: list[GpuSet] = []
        for _, group in itertools.groupby(items, key=lambda item: item[0]):
            members_list = [m for _, m in group]
            if len(members_list) > 1:
                quality = {m: remainder_quality(self.topology, free_set.difference(m)) for m in members_list}
                members_list.sort(key=lambda m: (-quality[m], m))
            out.extend(members_list)
        return out

    def single_order(self, free: Iterable[int]) -> list[int]:
        """The free GPUs in an order whose first N form good rings (see the module docstring)."""
        pool = sorted(set(free))
        if not pool:
            return []
        top = 1 << (len(pool).bit_length() - 1)
        chain = [tuple(pool) if top == len(pool) else best_subset(self.topology, pool, top).gpus]
        size = top // 2
        while size >= 1:
            chain.append(best_subset(self.topology, chain[-1], size).gpus)
            size //= 2
        order: list[int] = []
        for stage in [*reversed(chain), tuple(pool)]:
            while len(order) < len(stage):
                grown = best_subset(self.topology, stage, len(order) + 1, must_include=order).gpus
                order.append(next(g for g in grown if g not in order))
        return order

    def one_at_a_time_order(self, free: Iterable[int]) -> list[int]:
        """The free GPUs in the order repeated 1-GPU allocations take them (see the module docstring)."""
        left = set(free)
        order: list[int] = []
        while left:
            (g,) = best_subset(self.topology, left, 1).gpus
            order.append(g)
            left.discard(g)
        return order

    def select(self, size: int, limit: int) -> list[GpuSet]:
        """Up to `limit` sets of `size` GPUs, in static rank order (see the module docstring). Every set when
        they all fit; else the best by components (1)-(3), at most ceil(limit * size / n) sets per GPU in a first
        pass, then the next best regardless of that cap until `limit` is reached."""
        n = self.topology.size
        if not 1 <= size <= n:
            raise AllocationError(f"set size must be within 1..{n}, got {size}")
        if limit < 0:
            raise AllocationError(f"limit must be >= 0, got {limit}")
        every = list(itertools.combinations(range(n), size))
        every.sort(key=lambda m: (tuple(-x for x in self.static_key(m)), m))
        if len(every) <= limit:
            return every
        cap = math.ceil(limit * size / n)
        use = [0] * n
        chosen: list[GpuSet] = []
        rest: list[GpuSet] = []
        for m in every:
            if len(chosen) < limit and all(use[g] < cap for g in m):
                chosen.append(m)
                for g in m:
                    use[g] += 1
            else:
                rest.append(m)
        chosen += rest[: limit - len(chosen)]
        picked = set(chosen)
        return [m for m in every if m in picked]


def sets_of_size(gpus: Sequence[int], size: int) -> list[GpuSet]:
    """Every `size`-set of `gpus`, lexicographically (a convenience for callers that rank all of them)."""
    return list(itertools.combinations(sorted(gpus), size))
