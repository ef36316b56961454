"""The allocator against exhaustive search: the same score and, on ties, the same deterministic subset."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputopo.core import best_subset
from gputopo.core.allocator import clear_memo
from tests.gputopo.core.reference import exhaustive_best
from tests.gputopo.core.strategies import requests, topologies


def _as_score(alloc) -> tuple[int, int, int, int]:
    return (
        round(alloc.allreduce_gbps * 1000),
        round(alloc.total_gbps * 1000),
        -alloc.numa_nodes,
        round(alloc.remainder_quality * 1_000_000),
    )


def check(topo, avail, size, must) -> None:
    alloc = best_subset(topo, avail, size, must)
    ref_score, ref_set = exhaustive_best(topo, avail, size, must)
    assert _as_score(alloc) == ref_score, (alloc, ref_score, ref_set)
    assert alloc.gpus == ref_set
    assert alloc.optimal
    assert set(must) <= set(alloc.gpus) <= set(avail)
    assert len(set(alloc.gpus)) == size


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_topologies_match_exhaustive(data) -> None:
    topo = data.draw(topologies(2, 8))
    avail, size, must = data.draw(requests(topo))
    check(topo, avail, size, must)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_memoised_answer_equals_cold_answer(data) -> None:
    topo = data.draw(topologies(2, 8))
    avail, size, must = data.draw(requests(topo))
    first = best_subset(topo, avail, size, must)
    assert best_subset(topo, avail, size, must) == first
    clear_memo()
    assert best_subset(topo, avail, size, must) == first


def test_seeded_sweep_up_to_nine_gpus() -> None:
    """A fixed sweep of 300 machines (3-9 GPUs), full and partly used, every size."""
    import random

    from tests.gputopo.core.strategies import random_topology

    rng = random.Random(20261130)
    for _ in range(300):
        topo = random_topology(rng, rng.randint(3, 9))
        taken = set(rng.sample(range(topo.size), rng.randint(0, topo.size // 2)))
        avail = [i for i in range(topo.size) if i not in taken]
        size = rng.randint(1, len(avail))
        must = rng.sample(avail, rng.randint(0, min(2, size))) if rng.random() < 0.3 else []
        check(topo, avail, size, sorted(must))
