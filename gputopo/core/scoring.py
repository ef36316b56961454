"""How good a GPU subset is, by the quality model of DESIGN.md.

A subset's all-reduce estimate is the bottleneck of its best ring: the largest t such that the GPUs can be ordered in
a cycle whose every hop has at least t of bandwidth. That is a Hamiltonian-cycle question on the graph of links >= t,
answered exactly with a memoised depth-first search over bitmasks (subset sizes are small; the search finds a cycle at
once on the dense graphs real machines give).
"""

from __future__ import annotations

from collections.abc import Sequence

BwMatrix = Sequence[Sequence[int]]


class SearchLimitExceeded(Exception):
    """The Hamiltonian search hit its step budget (only used by the large-node heuristic)."""


def has_hamiltonian_cycle(adj: Sequence[int], k: int, step_limit: int | None = None) -> bool:
    """Whether the graph on vertices 0..k-1 (adjacency bitmasks) has a cycle through every vertex.

    k < 3 is handled by the caller. Failed (visited, last) states are memoised, so the worst case is the
    O(2^k k^2) dynamic programme, while a graph with a cycle is usually done after k steps.
    """
    full = (1 << k) - 1
    for v in range(k):
        if (adj[v] & ~(1 << v)).bit_count() < 2:
            return False
    failed: set[tuple[int, int]] = set()
    steps = 0
    # Iterative DFS from vertex 0; stack holds (visited mask, last vertex, remaining candidate mask).
    start_cands = adj[0] & ~1
    stack: list[tuple[int, int, int]] = [(1, 0, start_cands)]
    while stack:
        visited, last, cands = stack[-1]
        if visited == full:
            if adj[last] & 1:
                return True
            failed.add((visited, last))
            stack.pop()
            continue
        if not cands:
            failed.add((visited, last))
            stack.pop()
            continue
        low = cands & -cands
        stack[-1] = (visited, last, cands & ~low)
        nxt = low.bit_length() - 1
        nvisited = visited | low
        if (nvisited, nxt) in failed:
            continue
        steps += 1
        if step_limit is not None and steps > step_limit:
            raise SearchLimitExceeded
        stack.append((nvisited, nxt, adj[nxt] & ~nvisited))
    return False


def ring_bottleneck_mbps(bw: BwMatrix, members: Sequence[int], step_limit: int | None = None) -> int:
    """Bottleneck of the best ring through `members` (MB/s). 0 for a single GPU: it needs no communication."""
    k = len(members)
    if k <= 1:
        return 0
    if k == 2:
        return bw[members[0]][members[1]]
    values = sorted({bw[a][b] for i, a in enumerate(members) for b in members[i + 1 :]}, reverse=True)
    # A ring uses two links at each GPU: the bottleneck is at most every GPU's second-best link.
    cap = min(sorted((bw[a][b] for b in members if b != a), reverse=True)[1] for a in members)
    for t in values:
        if t > cap:
            continue
        if ring_at_least(bw, members, t, step_limit):
            return t
    return values[-1]


def ring_at_least(bw: BwMatrix, members: Sequence[int], t: int, step_limit: int | None = None) -> bool:
    k = len(members)
    if k <= 2:
        return k < 2 or bw[members[0]][members[1]] >= t
    adj = []
    for a in members:
        row = bw[a]
        mask = 0
        for pos, b in enumerate(members):
            if b != a and row[b] >= t:
                mask |= 1 << pos
        adj.append(mask)
    return has_hamiltonian_cycle(adj, k, step_limit)


def total_mbps(bw: BwMatrix, members: Sequence[int]) -> int:
    return sum(bw[a][b] for i, a in enumerate(members) for b in members[i + 1 :])


def numa_span(numa: Sequence[int | None], members: Sequence[int]) -> int:
    """Distinct NUMA nodes spanned; unknown NUMA counts as one shared node (a VM that hides NUMA)."""
    return len({numa[m] for m in members})
