"""What a topology-blind pick would have given, for reports and benchmarks.

Without a preference the kubelet takes devices in Go map order: effectively a uniformly random subset of the free
GPUs. Its expected all-reduce estimate is the mean over all subsets of that size (exact below 5,000 subsets,
sampled with a fixed seed beyond). The lowest-index pick is what a naive plugin that sorts ids would do.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from gputopo.core import Topology, allreduce_gbps

_EXACT_LIMIT = 5_000


@dataclass(frozen=True)
class BlindPick:
    random_mean_gbps: float
    random_worst_gbps: float
    lowest_index_gbps: float


def blind_pick(topo: Topology, available: Sequence[int], size: int, seed: int = 0) -> BlindPick:
    free = sorted(available)
    if math.comb(len(free), size) <= _EXACT_LIMIT:
        values = [allreduce_gbps(topo, c) for c in itertools.combinations(free, size)]
    else:
        rng = random.Random(seed)
        values = [allreduce_gbps(topo, rng.sample(free, size)) for _ in range(_EXACT_LIMIT)]
    return BlindPick(
        random_mean_gbps=sum(values) / len(values),
        random_worst_gbps=min(values),
        lowest_index_gbps=allreduce_gbps(topo, free[:size]),
    )
