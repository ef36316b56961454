"""Placement efficiency, defined once. Two ratios answer two questions, and every report names which one it shows:

- efficiency vs the empty node: a GPU set's all-reduce estimate / the best any set of its size reaches on the same
  node when all its GPUs are free. How close to what the node can do the pod runs: fragmentation left by earlier
  pods lowers it, so it measures the placement policy over time (the README, the demo, the churn benchmarks, the
  extender's metric and the pods' placement annotation).
- efficiency vs the free set: the same estimate / the best any set of its size reaches among the GPUs that were
  free when it was chosen. How well the allocator chose from what it was given, whatever the fragmentation (the
  allocator benchmark; `gpuplugin plan --available`).

A single GPU has no all-reduce: its efficiency is 1.0 either way; so is a set whose best is 0 GB/s.
"""

from __future__ import annotations

from collections.abc import Iterable

from gputopo.core.allocator import allreduce_gbps, best_possible_gbps
from gputopo.core.topology import Topology

VS_EMPTY = "efficiency vs the empty node"
VS_FREE = "efficiency vs the free set"
DEFINITIONS = {
    VS_EMPTY: "all-reduce estimate / the best for its size on the same node when empty",
    VS_FREE: "all-reduce estimate / the best for its size among the GPUs free when it was chosen",
}


def efficiency_ratio(gbps: float, best_gbps: float, size: int) -> float:
    """The ratio both definitions share, given the reference best (1.0 for one GPU or a best of 0)."""
    if size <= 1 or best_gbps <= 0:
        return 1.0
    return gbps / best_gbps


def efficiency_vs_empty(topology: Topology, gpus: Iterable[int]) -> float:
    """Efficiency vs the empty node of the set `gpus` (indices)."""
    chosen = list(gpus)
    if len(chosen) <= 1:
        return 1.0
    best = best_possible_gbps(topology, len(chosen))
    return efficiency_ratio(allreduce_gbps(topology, chosen), best, len(chosen))


def efficiency_vs_free(topology: Topology, gpus: Iterable[int], free: Iterable[int]) -> float:
    """Efficiency vs the free set of the set `gpus`, chosen among `free` (indices; `gpus` lies inside it)."""
    chosen = list(gpus)
    if len(chosen) <= 1:
        return 1.0
    best = best_possible_gbps(topology, len(chosen), free)
    return efficiency_ratio(allreduce_gbps(topology, chosen), best, len(chosen))
