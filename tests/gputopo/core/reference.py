"""Exhaustive reference for the allocator: every subset, every ring, the score of DESIGN.md computed the slow way.

It shares no search code with gputopo.core.allocator: rings are enumerated as permutations, remainders by brute
force. Only the bandwidth matrix and NUMA ids come from the topology.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from gputopo.core.topology import Topology

COMMON_SIZES = (2, 4, 8)
UNIT = 1_000_000


def ring_bottleneck(bw: Sequence[Sequence[int]], members: Sequence[int]) -> int:
    k = len(members)
    if k <= 1:
        return 0
    if k == 2:
        return bw[members[0]][members[1]]
    first, rest = members[0], members[1:]
    best = 0
    for perm in itertools.permutations(rest):
        if perm[0] > perm[-1]:
            continue  # each ring once per direction
        cycle = (first, *perm)
        best = max(best, min(bw[cycle[i]][cycle[(i + 1) % k]] for i in range(k)))
    return best


def best_ring(bw, pool: Sequence[int], s: int) -> int:
    if s <= 1 or len(pool) < s:
        return 0
    return max(ring_bottleneck(bw, c) for c in itertools.combinations(sorted(pool), s))


def score(topo: Topology, avail: Sequence[int], chosen: Sequence[int], empty_best: dict[int, int]):
    bw = topo.bandwidth_mbps
    numa = {topo.gpus[i].numa_node for i in chosen}
    remainder = sorted(set(avail) - set(chosen))
    quality = 0
    for s in COMMON_SIZES:
        if s > len(remainder):
            break
        if empty_best[s]:
            quality += best_ring(bw, remainder, s) * UNIT // empty_best[s]
    total = sum(bw[a][b] for a, b in itertools.combinations(chosen, 2))
    return (ring_bottleneck(bw, list(chosen)), total, -len(numa), quality)


def exhaustive_best(topo: Topology, avail: Sequence[int], size: int, must: Sequence[int] = ()):
    """(best score, lexicographically smallest subset with that score)."""
    full = list(range(topo.size))
    empty_best = {s: best_ring(topo.bandwidth_mbps, full, s) for s in COMMON_SIZES}
    free = sorted(set(avail) - set(must))
    best = None
    for extra in itertools.combinations(free, size - len(must)):
        chosen = tuple(sorted((*must, *extra)))
        sc = score(topo, avail, chosen, empty_best)
        if best is None or sc > best[0] or (sc == best[0] and chosen < best[1]):
            best = (sc, chosen)
    assert best is not None
    return best
