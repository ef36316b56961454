"""The answers kept per node name (extender.placement.memo's by-name tables, forgotten through
NodeCache.on_state_change) and the Fits kept one per value class must equal a fresh computation after any sequence of
node changes: used and unhealthy GPUs, cordons, nodes gone and back, reservations made by binds and released,
shared and MIG nodes. And a bind never plans a GPU that is in use or reserved (issue 24)."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from extender.config import ExtenderConfig
from extender.placement import policy
from extender.placement.engine import NoFit, Placement
from extender.placement.explain import offer
from extender.state.cache import NodeCache
from extender.state.pods import Need
from extender.state.reservations import Reservations
from gputopo.core.bitset import mask_of
from tests.extender.conftest import DGX1, PCIE, topo
from tests.extender.test_mig import ONE, mig_node, sevens
from tests.extender.test_sharing import SHARED, shared_node
from tests.helpers.kube import k8s_node

TOPOS = (topo(DGX1), topo(PCIE))
NAMES = [f"n{i}" for i in range(6)]
NEEDS = (Need(1), Need(2), Need(4), Need(8), Need(3, require_nvlink=True), Need(2, min_gbps=40.0),
         Need(2, resource=SHARED), Need(1, resource=ONE))

# one change to the cluster: (kind, node index, topology, used GPUs, unhealthy GPUs, need index)
changes = st.tuples(st.sampled_from(["whole", "cordon", "gone", "shared", "mig", "bind", "release"]),
                    st.integers(0, len(NAMES) - 1), st.integers(0, 1),
                    st.sets(st.integers(0, 7), max_size=8), st.sets(st.integers(0, 7), max_size=3),
                    st.integers(0, len(NEEDS) - 1))


def apply(cache: NodeCache, placement: Placement, change: tuple[Any, ...], binds: list[str]) -> None:
    kind, i, t, used, bad, k = change
    name, tp = NAMES[i], TOPOS[t]
    if kind in ("whole", "cordon"):
        node = k8s_node(name, tp, sorted(used), sorted(bad))
        node["spec"] = {"unschedulable": kind == "cordon"}
        cache.update_node(node)
    elif kind == "gone":
        cache.remove_node(name)
    elif kind == "shared":
        cache.update_node(shared_node(name, tp, 4, {g: 2 for g in used}, range(4)))
    elif kind == "mig":
        cache.update_node(mig_node(name, _mig(name, len(used) % 8)))
    elif kind == "bind":
        entry = cache.nodes.get(name)
        need = NEEDS[k]
        if entry is None or need.resource is not None:
            return
        with cache.lock_for(name):
            try:
                alloc = placement.choose(entry, cache.free_mask(entry), need)
            except NoFit:
                return
            mask = mask_of(alloc.gpus)
            # never a GPU in use, unhealthy or already reserved for another pod
            assert not mask & (entry.used_mask | entry.unhealthy_mask | cache.reservations.masks.get(name, 0))
            uid = f"uid-{len(binds)}"
            binds.append(uid)
            ids = [entry.topo.gpus[g].id for g in alloc.gpus]  # type: ignore[union-attr]
            cache.reservations.add(uid, "default", uid, name, ids, mask, "bind")
    elif kind == "release" and binds:
        cache.reservations.release(binds.pop(k % len(binds)))


def _mig(name: str, used: int) -> Any:
    from gputopo.core.codec import Mig
    return Mig("mixed", None, (sevens(name, 0, used), sevens(name, 1, 0)))


def reference_scores(cache: NodeCache, names: list[str], need: Need) -> tuple[list[int], Any]:
    """Today's ranking from scratch: each node's own best fit (no memo, no value classes), ranked and offered."""
    fits = []
    for name in names:
        state = cache.states.get(name)
        if state is None or state.problem is not None or state.total < need.size or state.free.bit_count() < need.size:
            fits.append(policy.NO_FIT)
            continue
        fit = policy.compute_fit(policy.TopologyFacts(cache.topologies[state.fingerprint]), state.free, need)
        fits.append(fit if fit.alloc is not None else policy.NO_FIT)
    cfg = cache.config
    ranking = policy.rank(fits, cfg.island_penalty, cfg.island_spare)
    return ranking.scores, offer(names, fits, ranking, cfg.island_penalty, cfg.island_spare)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(changes, min_size=1, max_size=40), st.lists(st.integers(0, len(NEEDS) - 1), min_size=1, max_size=4))
# a MIG node publishes other instances held: its placement state (whole GPUs only) stays the same object
@example([("mig", 0, 0, {1}, set(), 0), ("mig", 0, 0, {1, 2, 3}, set(), 0)], [len(NEEDS) - 1])
def test_kept_answers_equal_a_fresh_computation_after_any_changes(steps: list[tuple[Any, ...]], asked: list[int]
                                                                  ) -> None:
    cache = NodeCache(ExtenderConfig(), Reservations(60.0))
    kept = Placement(cache)
    binds: list[str] = []
    names = [*NAMES, "never-seen"]
    for n, change in enumerate(steps):
        apply(cache, kept, change, binds)
        # the kept answers are asked between changes, so later changes must forget them; over the same list, an
        # equal one (the last answers are patched), and another (they start over)
        asked_names = (names, list(names), names[1:])[n % 3]
        for k in asked:
            need = NEEDS[k]
            kept.filter(asked_names, need)
            kept.score_offer(asked_names, need)
    fresh = Placement(cache)
    for need in NEEDS:
        assert kept.filter(names, need) == fresh.filter(names, need), need
        assert kept.filter(names[1:], need) == fresh.filter(names[1:], need), need
        got = kept.score_offer(names, need)
        assert got == fresh.score_offer(names, need), need
        if fresh.shared_resource(need) is None and fresh.mig_resource(need) is None:
            assert got == reference_scores(cache, names, need), need
        mig = fresh.mig_resource(need)
        if mig is not None:  # the instances themselves: scores alone do not tell two choices of a node apart
            for entry in cache.nodes.values():
                assert kept.mig_choice(entry, mig, need) == fresh.mig_choice(entry, mig, need), (entry.name, need)


def test_fits_share_a_value_class_only_when_everything_the_ranking_reads_is_equal() -> None:
    from dataclasses import replace

    from extender.placement.memo import PlacementMemo

    memo = PlacementMemo()
    facts = policy.TopologyFacts(TOPOS[0])
    a = policy.compute_fit(facts, 0b11111111, Need(2))
    b = policy.compute_fit(facts, 0b11111111, Need(2))  # the same answer, another object
    assert a is not b and memo.value_class(a) is memo.value_class(b)
    for other in (replace(a, islands=((8, 1.0, 0.5),)), replace(a, packing=a.packing / 2), replace(a, gbps=a.gbps / 2)):
        assert memo.value_class(other) is other  # a class of its own: it ranks differently
    assert memo.value_class(policy.NO_FIT) is policy.NO_FIT
