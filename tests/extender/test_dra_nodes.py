"""DRA nodes ranked by the best free GPU set (extender.state.slices, extender.placement.dra, the DRA path of
extender.verbs): the view follows our driver's slices (highest complete generation, taints, published order) and the
claims' allocations; a pod's ask is read from its claims' requests; each node's offer mirrors the allocator (first
free in published order, tier by tier); filter --filter-best and prioritize prefer the node whose offer is fastest,
for template claims and for `nvidia.com/gpu: N` on DRA nodes; the expected set of a pod just ranked counts as held
until its claim shows an allocation."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import yaml

from extender.config import ExtenderConfig
from extender.placement.dra import RINGS, SET, DraAsk, Tier, claims_ask, offer, plain_ask, rank
from extender.service import Extender
from extender.state.slices import DraView
from extender.verbs import Verbs
from gputopo.contract import parse_dra_device
from tests.extender.conftest import write_inventory
from tests.helpers.paths import REPO
from tests.helpers.scheduler import cache_args, pod_json

DRIVER = "gpu-topology.io"


def _device(name: str, gbps: int | None = None, tainted: bool = False) -> dict[str, Any]:
    d: dict[str, Any] = {"name": name, "attributes": {}}
    if gbps is not None:
        d["attributes"]["allreduceGBps"] = {"int": gbps}
    if tainted:
        d["taints"] = [{"key": f"{DRIVER}/unhealthy", "effect": "NoSchedule"}]
    return d


def _pool(node: str, gpus: int, gbps: Any, *, generation: int = 1, order: list[int] | None = None,
          sizes: tuple[int, ...] = (2, 4, 8), tainted: frozenset[int] = frozenset(), split: int = 1
          ) -> list[dict[str, Any]]:
    """A pool as our driver publishes it: singles in `order`, sets of each size best first by gbps(members)."""
    order = order if order is not None else list(range(gpus))
    devices = [_device(f"gpu-{g}", tainted=g in tainted) for g in order]
    devices += [_device(f"one-{g}", tainted=g in tainted) for g in range(gpus)]
    for size in sizes:
        if size > gpus:
            continue
        sets = sorted(itertools.combinations(range(gpus), size), key=lambda m: -gbps(m))
        devices += [_device("set-" + "-".join(map(str, m)), gbps(m), tainted=not tainted.isdisjoint(m))
                    for m in sets]
    chunks = [devices[i::split] for i in range(split)]
    return [{"metadata": {"name": f"{node}-{DRIVER}-{i:05x}"},
             "spec": {"driver": DRIVER, "nodeName": node, "devices": chunk,
                      "pool": {"name": node, "generation": generation, "resourceSliceCount": split}}}
            for i, chunk in enumerate(chunks)]


def fast(m: tuple[int, ...]) -> int:  # NVSwitch: every set alike
    return 300


def islands(m: tuple[int, ...]) -> int:  # two NVLink quads 0-3 and 4-7 joined by PCIe
    return 100 if set(m) <= {0, 1, 2, 3} or set(m) <= {4, 5, 6, 7} else 20


def pcie(m: tuple[int, ...]) -> int:
    return 15


def _claim(name: str, requests: list[dict[str, Any]], *, owner: str = "", results: list[tuple[str, str]] = (),
           namespace: str = "default") -> dict[str, Any]:
    claim: dict[str, Any] = {"metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
                             "spec": {"devices": {"requests": requests}}}
    if owner:
        claim["metadata"]["ownerReferences"] = [{"kind": "Pod", "name": owner, "uid": owner}]
    if results:
        claim["status"] = {"allocation": {"devices": {"results": [
            {"request": "gpus", "driver": DRIVER, "pool": pool, "device": dev} for pool, dev in results]}}}
    return claim


def _template_requests(template: str) -> list[dict[str, Any]]:
    docs = yaml.safe_load_all((REPO / "deploy" / "dra" / "claim-templates.yaml").read_text())
    t = next(d for d in docs if d and d["metadata"]["name"] == template)
    return t["spec"]["spec"]["devices"]["requests"]  # type: ignore[no-any-return]


def _view(*pools: list[dict[str, Any]]) -> DraView:
    view = DraView(DRIVER)
    view.sync_slices([s for p in pools for s in p])
    return view


# -- the view --------------------------------------------------------------------------------------------------


def test_device_names_spell_their_gpus() -> None:
    assert parse_dra_device("gpu-3") == ("gpu", (3,))
    assert parse_dra_device("one-12") == ("one", (12,))
    assert parse_dra_device("set-0-1-2-3") == ("set", (0, 1, 2, 3))
    assert parse_dra_device("shared-1") is None and parse_dra_device("mig-0-1-0") is None


def test_a_pool_counts_only_once_complete_at_its_highest_generation() -> None:
    view = DraView(DRIVER)
    first, second = _pool("n1", 4, fast, split=2)
    view.apply_slice("ADDED", first)
    assert view.serves("n1") and view.nodes(["n1"]) == {}  # incomplete: the allocator skips it too
    view.apply_slice("ADDED", second)
    assert set(view.nodes(["n1"])) == {"n1"}
    newer = _pool("n1", 4, fast, generation=2, split=2)
    view.apply_slice("MODIFIED", newer[0])
    assert view.nodes(["n1"]) == {}  # generation 2 incomplete: the pool offers nothing meanwhile
    view.apply_slice("MODIFIED", newer[1])
    assert set(view.nodes(["n1"])) == {"n1"}
    for s in newer:
        view.apply_slice("DELETED", s)
    assert not view.serves("n1")


def test_other_drivers_and_tainted_devices_are_left_out() -> None:
    other = _pool("n2", 4, fast)
    other[0]["spec"]["driver"] = "gpu.example.com"
    view = _view(_pool("n1", 4, fast, tainted=frozenset({0})), other)
    assert not view.serves("n2")
    node, _ = view.nodes(["n1"])["n1"]
    assert 0 not in node.rings and all(0 not in m for ms in node.sets.values() for m, _ in ms)


def test_allocated_claims_hold_their_gpus_until_deleted() -> None:
    view = _view(_pool("n1", 8, islands))
    claim = _claim("c1", _template_requests("best-4-gpus"), results=[("n1", "set-0-1-2-3")])
    view.apply_claim("ADDED", claim)
    assert view.nodes(["n1"])["n1"][1] == {0, 1, 2, 3}
    view.apply_claim("DELETED", claim)
    assert view.nodes(["n1"])["n1"][1] == frozenset()


def test_an_expected_set_is_held_until_the_pods_claim_is_allocated_or_it_expires() -> None:
    now = [0.0]
    view = DraView(DRIVER, pending_s=5.0, clock=lambda: now[0])
    view.sync_slices(_pool("n1", 8, islands))
    view.expect("pod-a", "n1", (4, 5, 6, 7))
    assert view.nodes(["n1"])["n1"][1] == {4, 5, 6, 7}
    assert view.nodes(["n1"], exclude_pod="pod-a")["n1"][1] == frozenset()  # the pod's own expectation
    view.apply_claim("ADDED", _claim("c", _template_requests("best-4-gpus"), owner="pod-a",
                                     results=[("n1", "set-0-1-2-3")]))
    assert view.nodes(["n1"])["n1"][1] == {0, 1, 2, 3}  # the allocation replaces the expectation
    view.expect("pod-b", "n1", (4, 5))
    now[0] = 6.0
    assert view.nodes(["n1"])["n1"][1] == {0, 1, 2, 3}


# -- asks and offers -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("template", "size", "tiers"), [
    ("one-gpu", 1, ["one"]),
    ("best-2-gpus", 2, ["set", "set", "rings"]),
    ("best-4-gpus", 4, ["set", "set", "rings"]),
    ("best-8-gpus", 8, ["set", "set", "rings"]),
    ("four-gpus-one-nvlink-island", 4, ["set"]),
])
def test_the_templates_asks(template: str, size: int, tiers: list[str]) -> None:
    ask = claims_ask(_template_requests(template), DRIVER)
    assert ask is not None and ask.size == size and [t.kind for t in ask.tiers] == tiers
    if template.startswith("best-"):
        assert ask.tiers[0].min_gbps == 100 and ask.tiers[1].min_gbps == 0


def test_shares_and_mig_are_not_asks() -> None:
    for template in ("gpu-share", "gpu-three-shares", "mig-1g-10gb"):
        assert claims_ask(_template_requests(template), DRIVER) is None


def test_the_offer_is_the_first_free_set_of_the_first_tier_that_fits() -> None:
    node, _ = _view(_pool("n1", 8, islands)).nodes(["n1"])["n1"]
    ask = claims_ask(_template_requests("best-4-gpus"), DRIVER)
    assert ask is not None
    assert offer(node, frozenset(), ask) == offer(node, frozenset({5}), ask)  # quad 0-3 first either way
    got = offer(node, frozenset({0, 5}), ask)  # no free quad: the fast tier fails, the first free set
    assert got is not None and got.gbps == 20
    assert offer(node, frozenset(range(5)), ask) is None


def test_plain_requests_take_the_first_free_singles_in_ring_order() -> None:
    node, _ = _view(_pool("n1", 8, islands, order=[4, 5, 6, 7, 0, 1, 2, 3])).nodes(["n1"])["n1"]
    got = offer(node, frozenset({5}), plain_ask(4))
    assert got is not None and got.gpus == (0, 4, 6, 7) and got.gbps == 20
    assert offer(node, frozenset(), plain_ask(4)).gpus == (4, 5, 6, 7)  # type: ignore[union-attr]


def test_a_set_size_not_published_is_valued_by_its_slowest_pair() -> None:
    node, _ = _view(_pool("n1", 8, islands)).nodes(["n1"])["n1"]
    assert node.gbps_of((0, 1, 2)) == 100 and node.gbps_of((0, 1, 4)) == 20


def test_rank_prefers_the_fastest_offer_then_the_fuller_node() -> None:
    view = _view(_pool("a-pcie", 8, pcie), _pool("b-cube", 8, islands), _pool("c-switch", 8, fast),
                 _pool("d-switch", 8, fast))
    view.apply_claim("ADDED", _claim("c", [], results=[("d-switch", "set-0-1")]))
    names = ["a-pcie", "b-cube", "c-switch", "d-switch", "not-dra"]
    scores, offers = rank(view.nodes(names), names, DraAsk(4, (Tier(SET, 4, 100), Tier(SET, 4), Tier(RINGS, 4))))
    # d-switch: as fast as c-switch and fuller; the slower nodes in lower bands (extender.placement.scoring: within
    # the lowest band only the packing orders them)
    assert scores[3] == max(scores) > scores[2] > max(scores[0], scores[1]) and scores[4] == 0
    assert offers[4] is None


# -- the verbs -------------------------------------------------------------------------------------------------


@pytest.fixture
def verbs(tmp_path: Path) -> Any:
    """Verbs over an extender with an empty inventory and a DRA view set by hand (the watches' part)."""
    def make(view: DraView, **config: Any) -> Verbs:
        inv = write_inventory(tmp_path / "inventory.yaml", [])
        ext = Extender.standalone(inv, ExtenderConfig(**config))
        ext.dra = view
        return Verbs(ext, plan_in_thread=False)

    return make


def _cluster() -> DraView:
    return _view(_pool("a-pcie", 8, pcie), _pool("b-cube", 8, islands), _pool("c-switch", 8, fast),
                 _pool("d-cube", 8, islands))


def _template_pod(name: str, claim: str) -> dict[str, Any]:
    pod = pod_json(name, gpus=0)
    pod["spec"]["resourceClaims"] = [{"name": "gpus", "resourceClaimTemplateName": "best-4-gpus"}]
    pod["status"] = {"resourceClaimStatuses": [{"name": "gpus", "resourceClaimName": claim}]}
    return pod


NAMES = ["a-pcie", "b-cube", "c-switch", "d-cube"]


@pytest.mark.parametrize("kind", ["template", "plain"])
def test_prioritize_and_filter_best_prefer_the_node_with_the_best_free_set(verbs: Any, kind: str) -> None:
    view = _cluster()
    if kind == "template":
        view.apply_claim("ADDED", _claim("pod-claim", _template_requests("best-4-gpus")))
        pod = _template_pod("p", "pod-claim")
    else:
        pod = pod_json("p", gpus=4)
    scores = {h["Host"]: h["Score"] for h in verbs(view).prioritize(cache_args(pod, NAMES))}
    assert scores["c-switch"] > max(v for n, v in scores.items() if n != "c-switch")
    answer = verbs(view, filter_best=True).filter(cache_args(pod, NAMES))
    assert answer["NodeNames"] == ["c-switch"] and answer["FailedNodes"] == {}


def test_the_next_pod_of_a_burst_is_ranked_on_the_set_the_last_one_was_expected_to_take(verbs: Any) -> None:
    view = _view(_pool("a-cube", 8, islands), _pool("b-cube", 8, islands))
    v = verbs(view, filter_best=True)
    first = v.filter(cache_args(pod_json("p1", gpus=4, uid="u1"), ["a-cube", "b-cube"]))["NodeNames"]
    assert first == ["a-cube", "b-cube"]  # equals: both kept, kube-scheduler's own scores choose
    # p1 expected on a-cube (the first of the best), quad 0-3: its other quad is as fast, and a-cube is fuller
    second = v.filter(cache_args(pod_json("p2", gpus=4, uid="u2"), ["a-cube", "b-cube"]))["NodeNames"]
    assert second == ["a-cube"]
    v.ext.dra.forget_pod("u1")
    v.ext.dra.forget_pod("u2")
    assert v.filter(cache_args(pod_json("p3", gpus=4, uid="u3"), ["a-cube", "b-cube"]))["NodeNames"] == [
        "a-cube", "b-cube"]


def test_pods_without_gpu_claims_take_the_paths_before(verbs: Any) -> None:
    view = _cluster()
    pod = pod_json("cpu-only", gpus=0)
    assert verbs(view).prioritize(cache_args(pod, NAMES)) == [{"Host": n, "Score": 0} for n in NAMES]
    assert verbs(view, filter_best=True).filter(cache_args(pod, NAMES))["NodeNames"] == NAMES
    view.apply_claim("ADDED", _claim("share", _template_requests("gpu-share")))
    assert verbs(view).prioritize(cache_args(_template_pod("s", "share"), NAMES)) == [
        {"Host": n, "Score": 0} for n in NAMES]


def test_a_claim_not_seen_yet_or_already_allocated_gets_no_opinion(verbs: Any) -> None:
    view = _cluster()
    zeros = [{"Host": n, "Score": 0} for n in NAMES]
    assert verbs(view).prioritize(cache_args(_template_pod("p", "unseen"), NAMES)) == zeros
    view.apply_claim("ADDED", _claim("held", _template_requests("best-4-gpus"), results=[("b-cube", "set-0-1-2-3")]))
    assert verbs(view).prioritize(cache_args(_template_pod("p", "held"), NAMES)) == zeros
