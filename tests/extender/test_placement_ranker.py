"""policy.Ranker, which ranks request after request from what changed since its last call, must give exactly what
policy.rank gives from scratch, whatever the sequence of fit lists: states coming and going, counts moving across
the spare cut of a larger size, the best value and each band's packings changing (issue 24). And the cut both use
(policy.scarcity_cut) must say what scarce means, checked by counting the other candidates island by island."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extender.placement import policy
from extender.placement.policy import NO_FIT, Fit, Ranker

GBPS = (0.0, 10.0, 20.0, 40.0, 80.0, 160.0)  # few values, so equal befores and ties are common
PACKINGS = (0.1, 0.5, 0.5001, 0.9, 1.0)


@st.composite
def fits(draw: st.DrawFn) -> Fit:
    gbps = draw(st.sampled_from(GBPS))
    islands = tuple((s, before, draw(st.sampled_from([a for a in GBPS if a <= before])))
                    for s in draw(st.lists(st.sampled_from((2, 4, 8)), unique=True, max_size=3))
                    for before in [draw(st.sampled_from(GBPS))])
    return Fit(None, gbps, draw(st.sampled_from(PACKINGS)), islands=islands)


def same(a: policy.Ranking, b: policy.Ranking) -> None:
    assert a.scores == b.scores
    assert a.by_fit == b.by_fit
    assert a.counts == b.counts
    assert list(a.counts) == list(b.counts)  # explain.offer walks them in order


@settings(max_examples=300, deadline=None)
@given(st.lists(fits(), min_size=1, max_size=12), st.integers(0, 5), st.sampled_from((0.0, 0.5, 1.0, 3.0)),
       st.lists(st.lists(st.integers(0, 12), max_size=30), min_size=1, max_size=12))
def test_a_ranker_ranks_every_list_as_rank_does(pool: list[Fit], spare: int, penalty: float,
                                               lists: list[list[int]]) -> None:
    ranker = Ranker(penalty, spare)
    choices = [*pool, NO_FIT]
    for picks in lists:
        asked = [choices[i % len(choices)] for i in picks]
        same(ranker.rank(asked), policy.rank(asked, penalty, spare))


@settings(max_examples=300, deadline=None)
@given(st.lists(fits(), min_size=2, max_size=8), st.integers(0, 3), st.sampled_from((0.5, 1.0)),
       st.lists(st.integers(0, 8), min_size=1, max_size=20),
       st.lists(st.tuples(st.booleans(), st.integers(0, 40), st.integers(0, 8)), min_size=1, max_size=30))
def test_a_ranker_ranks_a_list_changing_a_node_at_a_time_as_rank_does(
        pool: list[Fit], spare: int, penalty: float, start: list[int], steps: list[tuple[bool, int, int]]) -> None:
    """As kube-scheduler's passed lists go, one pod after another: a node joins, leaves or changes its state."""
    ranker = Ranker(penalty, spare)
    choices = [*pool, NO_FIT]
    asked = [choices[i % len(choices)] for i in start]
    for grow, at, pick in steps:
        if grow or not asked:
            asked.insert(at % (len(asked) + 1), choices[pick % len(choices)])
        else:
            asked[at % len(asked)] = choices[pick % len(choices)]
        same(ranker.rank(asked), policy.rank(asked, penalty, spare))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(fits(), st.integers(1, 4)), min_size=1, max_size=10), st.integers(0, 5),
       st.sampled_from((0.5, 1.0, 3.0)))
def test_island_values_charge_exactly_the_scarce_islands(states: list[tuple[Fit, int]], spare: int,
                                                          penalty: float) -> None:
    """Scarce: fewer than `spare` other candidate nodes (nodes in the same state count) offer a free ring of that
    size at least as fast (within eps). Counted here for each island, node by node; raw values under the ranking's
    level (1% of its smallest GB/s) mapped into (0, level) as policy's docstring says, single GPUs worth 0."""
    counts = dict(states)  # one count per distinct state (the last one drawn)

    def scarce(s: int, before: float) -> bool:
        offering = sum(n for f, n in counts.items() for s2, b2, _ in f.islands if s2 == s and b2 >= before - 1e-9)
        return offering - 1 < spare

    raws = [f.gbps - penalty * sum(b - a for s, b, a in f.islands if scarce(s, b) and b > a) for f in counts]
    level = 0.01 * min((f.gbps for f in counts if f.gbps > 0), default=0.0)
    expected = [0.0 if f.gbps <= 0 else raw if raw >= level else level * level / (2 * level - raw)
                for f, raw in zip(counts, raws, strict=True)]
    assert policy.island_values(counts, penalty, spare) == pytest.approx(expected, abs=1e-9)
    for f in counts:
        assert policy.scarce_islands(counts, f, spare) == [i for i in f.islands if scarce(i[0], i[1])]


def test_a_ranker_that_failed_starts_over() -> None:
    good = Fit(None, 40.0, 0.5, islands=((4, 80.0, 40.0),))
    ranker = Ranker(1.0, 1)
    ranker.rank([good, good])
    bad = Fit(None, 40.0, 0.5, islands=((4, "fast", 40.0),))  # type: ignore[arg-type]
    try:
        ranker.rank([good, bad])
    except TypeError:
        pass
    else:
        raise AssertionError("a malformed fit must fail")
    same(ranker.rank([good]), policy.rank([good], 1.0, 1))
