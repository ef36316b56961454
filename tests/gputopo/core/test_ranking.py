"""Set ranking and single-GPU order (gputopo.core.ranking) against the allocator and against exhaustive search."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gputopo.core import AllocationError, best_subset
from gputopo.core.ranking import SetRanker
from gputopo.core.topology import Topology
from gputopo.discovery.loader import load_topology_file
from tests.gputopo.core.reference import COMMON_SIZES, best_ring, exhaustive_best, score
from tests.gputopo.core.strategies import topologies
from tests.helpers.paths import SHARED


@pytest.fixture(scope="module")
def dgx1() -> Topology:
    return load_topology_file(SHARED / "topologies" / "dgx1-v100-ucxpy.txt")


SLOW_OK = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def free_sets(draw, topo):
    n = topo.size
    free = draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
    return sorted(free)


@SLOW_OK
@given(st.data())
def test_first_ranked_set_is_the_allocators_choice(data) -> None:
    topo = data.draw(topologies(2, 8))
    free = data.draw(free_sets(topo))
    size = data.draw(st.integers(1, len(free)))
    ranked = SetRanker(topo).rank(free, itertools.combinations(free, size))
    assert ranked[0] == best_subset(topo, free, size).gpus


@SLOW_OK
@given(st.data())
def test_ranking_is_the_exhaustive_score_order(data) -> None:
    topo = data.draw(topologies(2, 7))
    free = data.draw(free_sets(topo))
    size = data.draw(st.integers(1, len(free)))
    empty_best = {s: best_ring(topo.bandwidth_mbps, range(topo.size), s) for s in COMMON_SIZES}
    every = list(itertools.combinations(free, size))
    expected = sorted(every, key=lambda m: (tuple(-x for x in score(topo, free, m, empty_best)), m))
    # a subset of the candidates keeps its relative order
    some = data.draw(st.lists(st.sampled_from(every), unique=True, min_size=1))
    assert SetRanker(topo).rank(free, every) == expected
    assert SetRanker(topo).rank(free, some) == [m for m in expected if m in set(some)]


@SLOW_OK
@given(st.data())
def test_single_order_prefixes_form_the_nested_best_chain(data) -> None:
    topo = data.draw(topologies(2, 8))
    free = data.draw(free_sets(topo))
    order = SetRanker(topo).single_order(free)
    assert sorted(order) == free
    top = 1 << (len(free).bit_length() - 1)
    assert tuple(sorted(order[:top])) == best_subset(topo, free, top).gpus
    size = top // 2
    while size:
        assert tuple(sorted(order[:size])) == best_subset(topo, order[: size * 2], size).gpus
        size //= 2


def test_single_order_of_a_dgx1_starts_with_an_nvlink_pair(dgx1) -> None:
    """The recorded trial gave an NV1 pair where an NV2 pair was free; the first two singles here are NV2."""
    order = SetRanker(dgx1).single_order(range(8))
    a, b = order[:2]
    assert dgx1.link(a, b).lanes == 2
    assert math.isclose(
        SetRanker(dgx1).static_key(order[:4])[0] / 1000, best_subset(dgx1, range(8), 4).allreduce_gbps
    )


@SLOW_OK
@given(st.data())
def test_one_at_a_time_order_is_the_exhaustive_best_single_of_what_is_left_each_time(data) -> None:
    topo = data.draw(topologies(2, 7))
    free = data.draw(free_sets(topo))
    order = SetRanker(topo).one_at_a_time_order(free)
    assert sorted(order) == free
    for i, g in enumerate(order):
        assert exhaustive_best(topo, order[i:], 1)[1] == (g,)


def test_one_at_a_time_keeps_the_best_free_quad_of_a_dgx1_whole(dgx1) -> None:
    """GPUs 0 and 1 held: ring order starts inside the NV2 quad 4-7; one at a time takes 2 and 3 first."""
    free = range(2, 8)
    assert SetRanker(dgx1).single_order(free)[0] in {4, 5, 6, 7}
    assert SetRanker(dgx1).one_at_a_time_order(free)[:2] == [2, 3]


def test_rank_refuses_a_set_outside_the_free_gpus(dgx1) -> None:
    with pytest.raises(AllocationError, match="not inside the free GPUs"):
        SetRanker(dgx1).rank([0, 1, 2], [(0, 3)])


def test_select_takes_every_set_when_they_fit_and_caps_each_gpus_share_when_not(dgx1) -> None:
    ranker = SetRanker(dgx1)
    assert len(ranker.select(4, 70)) == 70
    chosen = ranker.select(4, 20)
    assert len(chosen) == 20 == len(set(chosen))
    keys = [ranker.static_key(m) for m in chosen]
    assert keys == sorted(keys, reverse=True)
    counts = [sum(g in m for m in chosen) for g in range(8)]
    assert max(counts) <= math.ceil(20 * 4 / 8) and min(counts) > 0
    assert ranker.select(4, 20) == chosen  # deterministic
    assert ranker.select(2, 0) == []
    with pytest.raises(AllocationError):
        ranker.select(9, 1)
