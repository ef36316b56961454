"""Nodes empty out for autoscalers: among placements of equal value the extender prefers nodes whose GPUs are
already mostly busy, leaves lightly used and empty ones (and those an autoscaler marked as removal candidates) to
drain, never places on a node an autoscaler is removing, and says when it passed a node over so it could empty.
Bandwidth stays first: a faster set always outranks a busier node. Through the real verbs over HTTP against the
fake apiserver, and a property of the engine over random clusters."""

from __future__ import annotations

from typing import Any

import httpx
import kubernetes.client
from hypothesis import given, settings
from hypothesis import strategies as st

from extender.config import ExtenderConfig
from extender.placement.engine import Placement
from extender.state.cache import NodeCache, make_entry
from extender.state.pods import Need
from extender.state.reservations import Reservations
from gputopo.contract import CA_DELETION_CANDIDATE_TAINT, CA_TO_BE_DELETED_TAINT, KARPENTER_DISRUPTED_TAINT
from gputopo.core import best_subset
from tests.extender.conftest import A100, PCIE, topo
from tests.extender.test_cluster import cluster, filter_names
from tests.fakes.kubeapi import FakeKubeApi
from tests.helpers.kube import k8s_node, k8s_pod
from tests.helpers.scheduler import bind_body, cache_args

NVSWITCH = topo(A100)
PCIE_T = topo(PCIE)


def _tainted(node: dict[str, Any], key: str, effect: str) -> dict[str, Any]:
    node.setdefault("spec", {})["taints"] = [{"key": key, "effect": effect}]
    return node


def _scores(client: httpx.Client, pod: dict[str, Any], names: list[str]) -> dict[str, int]:
    r = client.post("/prioritize", json=cache_args(pod, names))
    assert r.status_code == 200
    return {h["Host"]: h["Score"] for h in r.json()}


def test_a_busy_node_outranks_a_lightly_used_one_that_packs_better(fake: FakeKubeApi,
                                                                   api: kubernetes.client.ApiClient) -> None:
    """A 2-GPU pod: the lightly used node keeps a better-shaped remainder (its packing value is higher), but the
    busy one is where it helps the autoscaler; with consolidation off the old order holds."""
    fake.add_node(k8s_node("light", NVSWITCH, used=[0, 1]))  # 2 of 8 in use: a scale-down candidate
    fake.add_node(k8s_node("busy", NVSWITCH, used=[0, 1, 2, 3, 4]))  # 5 of 8
    fake.add_node(k8s_node("empty", NVSWITCH))
    pod = fake.add_pod(k8s_pod("p", 2))
    names = ["light", "busy", "empty"]
    with cluster(api) as (_, client):
        on = _scores(client, pod, names)
    with cluster(api, consolidate=False) as (_, client):
        off = _scores(client, pod, names)
    assert on["busy"] > on["light"] > on["empty"]
    assert off["light"] > off["busy"], "without consolidation the remainder's shape decides"


def test_bandwidth_comes_before_consolidation(fake: FakeKubeApi, api: kubernetes.client.ApiClient) -> None:
    """A busy PCIe server never outranks an empty NVSwitch node for a 4-GPU pod: its set is far slower (the island
    penalty, which would keep a lone NVSwitch node for 8-GPU pods, is off here)."""
    fake.add_node(k8s_node("pcie-busy", PCIE_T, used=[0, 1, 2, 3]))
    fake.add_node(k8s_node("nvswitch-empty", NVSWITCH))
    pod = fake.add_pod(k8s_pod("p", 4))
    with cluster(api, island_penalty=0.0) as (_, client):
        scores = _scores(client, pod, ["pcie-busy", "nvswitch-empty"])
    assert scores["nvswitch-empty"] > scores["pcie-busy"]


def test_a_removal_candidate_ranks_below_an_equal_node(fake: FakeKubeApi, api: kubernetes.client.ApiClient) -> None:
    fake.add_node(_tainted(k8s_node("candidate", NVSWITCH, used=[0, 1, 2, 3]), CA_DELETION_CANDIDATE_TAINT,
                           "PreferNoSchedule"))
    fake.add_node(k8s_node("other", NVSWITCH, used=[0, 1, 2, 3]))
    pod = fake.add_pod(k8s_pod("p", 1))
    with cluster(api) as (_, client):
        scores = _scores(client, pod, ["candidate", "other"])
        assert filter_names(client, pod, ["candidate", "other"])["NodeNames"] == ["candidate", "other"]
    assert scores["other"] > scores["candidate"]


def test_nodes_being_removed_are_refused_with_the_taint_named(fake: FakeKubeApi,
                                                              api: kubernetes.client.ApiClient) -> None:
    """Nothing new lands on a node an autoscaler is draining, even for a pod that tolerates every taint."""
    fake.add_node(_tainted(k8s_node("ca", NVSWITCH), CA_TO_BE_DELETED_TAINT, "NoSchedule"))
    fake.add_node(_tainted(k8s_node("karpenter", NVSWITCH), KARPENTER_DISRUPTED_TAINT, "NoSchedule"))
    fake.add_node(k8s_node("ok", NVSWITCH))
    pod = k8s_pod("p", 1)
    pod["spec"]["tolerations"] = [{"operator": "Exists"}]
    pod = fake.add_pod(pod)
    with cluster(api) as (_, client):
        out = filter_names(client, pod, ["ca", "karpenter", "ok"])
    assert out["NodeNames"] == ["ok"]
    assert out["FailedAndUnresolvableNodes"]["ca"] == \
        f"node is being removed by an autoscaler (taint {CA_TO_BE_DELETED_TAINT})"
    assert KARPENTER_DISRUPTED_TAINT in out["FailedAndUnresolvableNodes"]["karpenter"]


def test_the_explanation_names_the_node_left_to_empty(fake: FakeKubeApi, api: kubernetes.client.ApiClient) -> None:
    fake.add_node(k8s_node("light", NVSWITCH, used=[0]))
    fake.add_node(k8s_node("busy", NVSWITCH, used=[0, 1, 2, 3, 4]))
    pod = fake.add_pod(k8s_pod("p", 2))
    with cluster(api) as (_, client):
        scores = _scores(client, pod, ["light", "busy"])
        assert scores["busy"] > scores["light"]
        assert client.post("/bind", json=bind_body(pod, "busy")).json() == {"Error": ""}
    stored = fake.pod("default", "p")
    assert stored is not None
    text = stored["metadata"]["annotations"]["gpu-topology.io/placement"]
    assert "passed over light, as fast but with fewer GPUs in use, so it can empty for the autoscaler" in text


_USED = st.lists(st.sets(st.integers(0, 7), max_size=8), min_size=2, max_size=6)


@settings(max_examples=150, deadline=None)
@given(used=_USED, kinds=st.lists(st.booleans(), min_size=6, max_size=6), size=st.sampled_from([1, 2, 3, 4, 8]))
def test_the_top_score_never_gives_up_bandwidth(used: list[set[int]], kinds: list[bool], size: int) -> None:
    """Over random clusters of NVSwitch and PCIe nodes: every node of the top score offers a set at least 0.999 of
    the fastest any node offers (consolidation only reorders nodes of equal value), and among those a node with
    at least half its GPUs busy is preferred over one with fewer whenever both are top-band candidates."""
    cache = NodeCache(ExtenderConfig(island_penalty=0.0), Reservations(60))
    placement = Placement(cache)
    names = []
    for i, u in enumerate(used):
        t = NVSWITCH if kinds[i] else PCIE_T
        cache.put_node(make_entry(f"n{i}", t, used=[t.gpus[g].id for g in u]))
        names.append(f"n{i}")
    need = Need(size)
    passed = placement.filter(names, need).passed
    if len(passed) < 2:
        return
    scores = dict(zip(passed, placement.score(passed, need), strict=True))
    top = max(scores.values())
    gbps = {}
    for n in passed:
        entry = cache.nodes[n]
        assert entry.topo is not None
        gbps[n] = best_subset(entry.topo, [g for g in range(8) if cache.free_mask(entry) >> g & 1], size).allreduce_gbps
    fastest = max(gbps.values())
    for n in passed:
        if scores[n] == top:
            assert gbps[n] >= 0.999 * fastest - 1e-9
    equal = [n for n in passed if gbps[n] >= 0.999 * fastest - 1e-9]
    busy = [n for n in equal if len(used[int(n[1:])]) >= 4]
    light = [n for n in equal if len(used[int(n[1:])]) < 4]
    if busy and light:
        assert max(scores[n] for n in busy) > max(scores[n] for n in light)
