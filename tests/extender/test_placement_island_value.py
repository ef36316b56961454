"""The island value (extender.placement.policy) orders fits as their raw value does, GB/s less what breaking scarce
larger islands costs, while staying positive: the demo's train-04 (issue found by running `gpuplugin demo`) went to
the only NVSwitch node because its pair, breaking the last whole 240 GB/s island (raw 240 - 240 = 0), was floored to
1% of its GB/s, 2.4, and so tied with an RTX 5090 pair breaking a 14.4 GB/s PCIe ring (raw 16.8 - 14.4 = 2.4)."""

from __future__ import annotations

from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from extender.config import ExtenderConfig
from extender.placement import policy
from extender.placement.policy import NO_FIT, Fit, Ranker, TopologyFacts, compute_fit
from extender.placement.scoring import BANDS, band_of, priority_scores
from extender.state.pods import Need
from gputopo.discovery.loader import load_topology_file
from sim.demo import NODES, bundled
from tests.extender.test_filter_prioritize import _scores
from tests.helpers.scheduler import pod_json

DEMO = dict(NODES)  # node name -> bundled topology file, as `gpuplugin demo` starts them
# the demo's nodes when train-04-2gpu arrives: the A6000 server full, the others empty
EMPTY = ("dgx1-v100-a", "dgx1-v100-b", "p4d-a100-nvswitch", "rtx5090-pcie")
DEFAULTS = ExtenderConfig()


def demo_fits(need: Need) -> dict[str, Fit]:
    return {name: compute_fit(TopologyFacts(load_topology_file(bundled(DEMO[name]))), 0xFF, need) for name in EMPTY}


def test_the_demo_pair_takes_the_pcie_server_not_the_last_nvswitch_island() -> None:
    """Four nodes offer an 8-GPU ring and the spare is 4, so every one is scarce and every pair breaks its node's.
    The raw values: NVSwitch 240 - 240 = 0, DGX-1 40 - 40 = 0, RTX 5090 16.8 - 14.4 = 2.4 (packing alike)."""
    fits = demo_fits(Need(2))
    assert {n: f.gbps for n, f in fits.items()} == {"dgx1-v100-a": 40.0, "dgx1-v100-b": 40.0,
                                                    "p4d-a100-nvswitch": 240.0, "rtx5090-pcie": 16.8}
    assert len({f.packing for f in fits.values()}) == 1
    penalty, spare = DEFAULTS.island_penalty, DEFAULTS.island_spare
    ranking = policy.rank(list(fits.values()), penalty, spare)
    scores = dict(zip(fits, ranking.scores, strict=True))
    assert scores["rtx5090-pcie"] == 10
    assert scores["rtx5090-pcie"] > max(s for n, s in scores.items() if n != "rtx5090-pcie")
    assert Ranker(penalty, spare).rank(list(fits.values())).scores == ranking.scores
    # greedy (no penalty) the NVSwitch pair is the fastest, and wins
    greedy = dict(zip(fits, policy.rank(list(fits.values()), 0.0, spare).scores, strict=True))
    assert greedy["p4d-a100-nvswitch"] == 10 and greedy["rtx5090-pcie"] < 10


def test_the_demo_pair_takes_the_pcie_server_through_prioritize(standalone) -> None:
    """The same, as kube-scheduler asks it: the extender's prioritize over HTTP, the A6000 server full."""
    nodes = [{"name": name, "topology": bundled(file), **({"used": list(range(8))} if name == "a6000-bridges" else {})}
             for name, file in NODES]
    with standalone(nodes) as (_, client):
        s = _scores(client, pod_json(gpus=2), list(EMPTY))
    assert s["rtx5090-pcie"] == 10
    assert s["p4d-a100-nvswitch"] < s["rtx5090-pcie"] and s["dgx1-v100-a"] < s["rtx5090-pcie"]


def test_of_two_pairs_breaking_islands_alike_the_one_that_destroys_less_ranks_higher() -> None:
    """The demo's train-08: the RTX 5090 server full, the NVSwitch node and both DGX-1s empty. A DGX-1 pair (40 - 40)
    and the NVSwitch pair (240 - 240) have one raw value; the DGX-1 destroys 40 GB/s of scarce 8-GPU ring, the
    NVSwitch node 240, so the DGX-1 ranks strictly higher and the 240 GB/s island waits for the 8-GPU pod."""
    fits = {n: f for n, f in demo_fits(Need(2)).items() if n != "rtx5090-pcie"}
    penalty, spare = DEFAULTS.island_penalty, DEFAULTS.island_spare
    ranking = policy.rank(list(fits.values()), penalty, spare)
    scores = dict(zip(fits, ranking.scores, strict=True))
    assert scores["dgx1-v100-a"] == scores["dgx1-v100-b"] == 10 and scores["p4d-a100-nvswitch"] < 10
    assert Ranker(penalty, spare).rank(list(fits.values())).scores == ranking.scores


def test_breaking_the_fastest_island_no_longer_beats_a_pcie_pair_that_breaks_less() -> None:
    """The old floor (1% of a fit's own GB/s) even inverted the order: a 240 GB/s pair breaking a scarce 240 GB/s
    island (raw 0, floored to 2.4) beat a 16.8 GB/s pair breaking a 15.8 GB/s ring (raw 1.0)."""
    nvswitch = Fit(None, 240.0, 0.4, islands=((8, 240.0, 0.0),))
    pcie = Fit(None, 16.8, 0.4, islands=((8, 15.8, 0.0),))
    values = policy.island_values({nvswitch: 1, pcie: 1}, 1.0, 4)
    assert 0 < values[0] < values[1] == 16.8 - 15.8
    nv_score, pcie_score = policy.rank([nvswitch, pcie], 1.0, 4).scores
    assert pcie_score > nv_score


GBPS = (0.0, 2.4, 14.4, 15.8, 16.8, 40.0, 80.0, 240.0)  # the demo's figures (and one more ring): ties are common
PACKINGS = (0.1, 0.4, 0.4018, 0.9)


@st.composite
def fits(draw: st.DrawFn, size_one: bool = False) -> Fit:
    gbps = 0.0 if size_one else draw(st.sampled_from(GBPS[1:]))
    # an island as fast as the pair itself, broken whole, is common (a pair of a whole NVSwitch node or DGX-1)
    islands = tuple((s, before, draw(st.sampled_from([a for a in GBPS if a <= before])))
                    for s in draw(st.lists(st.sampled_from((4, 8)), unique=True, max_size=2))
                    for before in [draw(st.sampled_from((gbps, gbps, *GBPS)))])
    return Fit(None, gbps, draw(st.sampled_from(PACKINGS)), islands=islands)


@st.composite
def whole_breakers(draw: st.DrawFn) -> Fit:
    """Pairs that break an 8-GPU island as fast as themselves, whole (raw value 0 at penalty 1, whatever the GB/s),
    now and then a 4-GPU one too: equal raw values with unequal losses."""
    gbps = draw(st.sampled_from(GBPS[1:]))
    more = draw(st.lists(st.tuples(st.just(4), st.sampled_from(GBPS), st.just(0.0)), max_size=1))
    return Fit(None, gbps, draw(st.sampled_from((0.4, 0.9))), islands=((8, gbps, 0.0), *more))


def nodes(counts: dict[Fit, int]) -> list[Fit]:
    """A prioritize list with `counts` nodes in each state, and one where the pod no longer fits."""
    return [f for f, n in counts.items() for _ in range(n)] + [NO_FIT]


def raws(counts: dict[Fit, int], penalty: float, spare: int) -> list[float]:
    cuts = {s: policy.scarcity_cut(at, spare) for s, at in policy.island_supply(counts).items()}
    return [policy.raw_value(f, cuts, penalty) for f in counts]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(fits(), st.integers(1, 3)), min_size=1, max_size=8), st.integers(0, 5),
       st.sampled_from((0.0, 0.5, 1.0, 3.0)))
def test_values_are_positive_and_follow_the_raw_values(states: list[tuple[Fit, int]], spare: int,
                                                        penalty: float) -> None:
    """Every pair of distinct fits, compared exhaustively: a lower raw value never gets a higher value, a raw value
    lower by more than float noise gets a strictly lower one, and no value reaches 0."""
    counts = dict(states)
    raw = raws(counts, penalty, spare)
    values = policy.island_values(counts, penalty, spare)
    assert all(v > 0 for v in values)
    for ra, va in zip(raw, values, strict=True):
        for rb, vb in zip(raw, values, strict=True):
            if ra == rb:
                assert va == vb
            if ra < rb:
                assert va <= vb
            if ra < rb - 1e-9:
                assert va < vb, (raw, values)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(fits(), st.integers(1, 3)), min_size=1, max_size=8), st.integers(0, 5),
       st.sampled_from((0.0, 0.5, 1.0, 3.0)))
def test_a_ranking_where_no_value_was_floored_is_unchanged(states: list[tuple[Fit, int]], spare: int,
                                                            penalty: float) -> None:
    """Where every raw value reaches its fit's old floor (1% of its GB/s), values and scores are the old rule's."""
    counts = dict(states)
    raw = raws(counts, penalty, spare)
    old = [max(r, policy.VALUE_FLOOR * f.gbps) for f, r in zip(counts, raw, strict=True)]
    if any(r < policy.VALUE_FLOOR * f.gbps for f, r in zip(counts, raw, strict=True)):
        return
    assert policy.island_values(counts, penalty, spare) == old
    by_fit = policy.rank(nodes(counts), penalty, spare).by_fit
    assert [by_fit[f] for f in counts] == priority_scores([(v, f.packing) for f, v in zip(counts, old, strict=True)])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(fits(), st.integers(1, 3)), min_size=1, max_size=8), st.integers(0, 5),
       st.sampled_from((0.5, 1.0, 3.0)))
@example([(Fit(None, 240.0, 0.4, islands=((8, 240.0, 0.0),)), 1), (Fit(None, 16.8, 0.4, islands=((8, 15.8, 0.0),)), 1)],
         4, 1.0)  # the old floor's inversion
def test_a_higher_raw_value_never_scores_lower_at_equal_or_better_packing(states: list[tuple[Fit, int]],
                                                                           spare: int, penalty: float) -> None:
    counts = dict(states)
    raw = dict(zip(counts, raws(counts, penalty, spare), strict=True))
    score = policy.rank(nodes(counts), penalty, spare).by_fit
    for a in counts:
        for b in counts:
            if raw[a] > raw[b] + 1e-3 and a.packing >= b.packing:  # the order key rounds raw values
                assert score[a] >= score[b]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(whole_breakers(), st.integers(1, 3)), min_size=2, max_size=5),
       st.lists(st.tuples(fits(), st.integers(1, 3)), max_size=3),
       st.sampled_from((1, 4, 24)), st.sampled_from((1.0, 1.0, 0.5)))  # spare 24: every island scarce
@example([(Fit(None, 40.0, 0.4, islands=((8, 40.0, 0.0),)), 2), (Fit(None, 240.0, 0.4, islands=((8, 240.0, 0.0),)), 1)],
         [], 4, 1.0)  # the demo's train-08
def test_of_equal_choices_below_the_level_the_one_that_destroys_less_scores_higher(
        breakers: list[tuple[Fit, int]], others: list[tuple[Fit, int]], spare: int, penalty: float) -> None:
    """Equal raw values, both below the value level, equal packing: the fit that destroys less scarce GB/s scores
    at least as high, strictly higher when its band has a level for every distinct order key."""
    counts = dict(breakers + others)
    cuts = {s: policy.scarcity_cut(at, spare) for s, at in policy.island_supply(counts).items()}
    level = policy.value_level(f.gbps for f in counts)
    standing = dict(zip(counts, policy.standings(counts, penalty, spare), strict=True))
    best = max(v for v, _ in standing.values())
    band = {f: band_of(v, best) for f, (v, _) in standing.items()}
    score = policy.rank(nodes(counts), penalty, spare).by_fit
    raw = {f: policy.raw_value(f, cuts, penalty) for f in counts}
    loss = {f: policy.scarce_loss(f, cuts) for f in counts}
    for a in counts:
        for b in counts:
            if (raw[a] < level and raw[a] == raw[b] and a.packing == b.packing and loss[a] < loss[b] - 1e-3):
                event("equal choices below the level")
                assert score[a] >= score[b]
                room = BANDS[band[a]][2]
                if len({k for f, (_, k) in standing.items() if band[f] == band[a]}) <= room:
                    assert score[a] > score[b]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(fits(size_one=True), st.integers(1, 3)), min_size=1, max_size=6), st.integers(0, 5))
def test_single_gpus_are_all_worth_zero(states: list[tuple[Fit, int]], spare: int) -> None:
    """A single GPU has no GB/s to weigh against islands: every single-GPU fit shares band 0, packing decides."""
    assert set(policy.island_values(dict(states), 1.0, spare)) == {0.0}
