"""Replicas of shared GPUs (issue 22, the extender's half) through real HTTP with kube-scheduler's recorded bodies:
k replicas on k distinct GPUs, the best ring among those with a free replica, packing of 1-replica pods, clear
refusals, plans naming parent GPUs, reservations counted per GPU so concurrent binds never over-book, in standalone
(inventory) and cluster mode (the fake apiserver, nodes publishing the contract's state annotation)."""

from __future__ import annotations

import itertools
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extender.placement.reasons import Failed, Unresolvable
from extender.placement.shared import SharedChoice, shared_choice
from extender.service import Extender
from extender.state.cache import make_entry
from extender.state.inventory import InventoryError, parse_inventory
from extender.state.sharing import node_sharing
from gputopo.contract import parse_plan
from gputopo.core import NodeState, Topology, allreduce_gbps, state_to_json, topology_to_json
from gputopo.core.codec import SharedGpu, SharedResource, Sharing
from tests.extender.conftest import A100, DGX1, PCIE, running, topo
from tests.extender.test_cluster import cluster, filter_names
from tests.fakes.kubeapi import FakeKubeApi
from tests.helpers.clients import thread_clients
from tests.helpers.kube import GPU, PREFIX, k8s_node, k8s_pod
from tests.helpers.paths import REPO
from tests.helpers.scheduler import bind_body, cache_args, list_args, node_item, pod_json, recorded

SHARED = "nvidia.com/gpu.shared"
PLAN, PLACEMENT = f"{PREFIX}/plan", f"{PREFIX}/placement"


def shared_pod(n: int, resource: str = SHARED, *, whole: int = 0, name: str = "infer") -> dict[str, Any]:
    """The recorded Pod asking for `n` of `resource` (and `whole` nvidia.com/gpu beside it)."""
    pod = pod_json(name, 0)
    limits = {resource: str(n), **({GPU: str(whole)} if whole else {})}
    pod["spec"]["containers"][0]["resources"] = {"limits": limits, "requests": dict(limits)}
    return pod


def sharing_block(replicas: int = 4, devices: list[int] | None = None, used: dict[int, int] | None = None,
                  name: str = SHARED, one_per_pod: bool = False) -> dict[str, Any]:
    """The inventory's `sharing` block."""
    res: dict[str, Any] = {"name": name, "replicas": replicas}
    if devices is not None:
        res["devices"] = devices
    if used:
        res["used"] = used
    return {"strategy": "time-slicing", "failRequestsGreaterThanOne": one_per_pod, "resources": [res]}


def inventory_shared(client: httpx.Client, node: str) -> dict[str, list[list[Any]]]:
    return next(n for n in client.get("/inventory").json()["nodes"] if n["name"] == node).get("shared", {})


def plans(client: httpx.Client) -> dict[str, dict[str, Any]]:
    return {p["name"]: p["plan"] for p in client.get("/inventory").json()["pods"]}


# -- standalone (inventory) ------------------------------------------------------------------------------------------


def test_two_replicas_go_to_two_distinct_gpus_the_best_ring_of_those_with_a_free_one(standalone) -> None:
    d = topo(DGX1)
    # GPUs 0-3 shared (4 replicas each); GPU 0 and 1 are full, so the pair comes from 2 and 3
    nodes = [{"name": "dgx", "topology": DGX1, "sharing": sharing_block(4, [0, 1, 2, 3], {0: 4, 1: 4})}]
    pod = shared_pod(2)
    with standalone(nodes) as (_, client):
        out = client.post("/filter", json=cache_args(pod, ["dgx"])).json()
        assert out["NodeNames"] == ["dgx"] and out["Error"] == ""
        assert client.post("/bind", json=bind_body(pod, "dgx")).json() == {"Error": ""}
        plan = plans(client)["infer"]
        shared = inventory_shared(client, "dgx")
    assert plan["resource"] == SHARED and sorted(plan["containers"]["main"]) == ["GPU2", "GPU3"]
    assert plan["gbps"] == allreduce_gbps(d, [2, 3])
    assert shared[SHARED] == [["GPU0", 4, 4], ["GPU1", 4, 4], ["GPU2", 4, 1], ["GPU3", 4, 1]]


def test_refusals_name_the_reason(standalone) -> None:
    nodes = [
        {"name": "full", "topology": DGX1, "sharing": sharing_block(2, [0, 1, 2], {0: 2, 1: 2}), "unhealthy": [2]},
        {"name": "one-each", "topology": DGX1, "sharing": sharing_block(4, one_per_pod=True)},
        {"name": "few", "topology": DGX1, "sharing": sharing_block(4, [5])},
        {"name": "whole", "topology": A100},
    ]
    names = [n["name"] for n in nodes]
    with standalone(nodes) as (_, client):
        out = client.post("/filter", json=cache_args(shared_pod(2), names)).json()
        both = client.post("/filter", json=cache_args(shared_pod(1, whole=1), names)).json()
    assert out["NodeNames"] == []
    assert out["FailedNodes"] == {"full": f"needs 2 replicas of {SHARED} on 2 distinct GPUs, 0 GPUs with a free "
                                          "one: GPU 0,1 full, GPU 2 unhealthy"}
    unres = out["FailedAndUnresolvableNodes"]
    assert unres["one-each"] == (f"a container asks for 2 replicas of {SHARED}; this node's sharing config refuses "
                                 "more than one per container (failRequestsGreaterThanOne)")
    assert unres["few"] == f"needs 2 replicas of {SHARED} on 2 distinct GPUs, node shares only 1 GPU that way"
    assert unres["whole"] == f"shares no GPU as {SHARED}"
    assert both["NodeNames"] == [] and "not both" in both["Error"] and SHARED in both["Error"]


def test_a_pod_asking_replicas_of_two_shared_resources_is_refused(standalone) -> None:
    block = {"strategy": "mps", "resources": [{"name": SHARED, "replicas": 2, "devices": [0, 1]},
                                              {"name": "example.com/gpu.small", "replicas": 4, "devices": [2, 3]}]}
    pod = shared_pod(1)
    pod["spec"]["containers"][0]["resources"]["limits"]["example.com/gpu.small"] = "1"
    with standalone([{"name": "n", "topology": DGX1, "sharing": block}]) as (_, client):
        out = client.post("/filter", json=cache_args(pod, ["n"])).json()
        bad = client.post("/bind", json=bind_body(pod, "n")).json()["Error"]
    assert out["NodeNames"] == [] and out["Error"] == (
        f"pod cannot be placed: asks for replicas of example.com/gpu.small and of {SHARED}: a pod takes replicas of "
        "one shared resource")
    assert "was never seen" in bad  # nothing remembered, nothing bound


def test_one_replica_packs_onto_the_gpu_already_shared_most_and_keeps_idle_nodes(standalone) -> None:
    nodes = [
        {"name": "idle-nvswitch", "topology": A100, "sharing": sharing_block(4)},
        {"name": "busy", "topology": DGX1, "sharing": sharing_block(4, used={5: 1, 6: 3})},
        {"name": "busy-full", "topology": DGX1, "sharing": sharing_block(4, used={i: 4 for i in range(8)})},
    ]
    names = [n["name"] for n in nodes]
    with standalone(nodes) as (_, client):
        pods = [shared_pod(1, name=f"nb-{i}") for i in range(3)]
        landed = []
        for pod in pods:
            out = client.post("/filter", json=cache_args(pod, names)).json()
            assert "busy-full" in out["FailedNodes"]
            scores = {s["Host"]: s["Score"] for s in client.post("/prioritize", json=cache_args(pod, out["NodeNames"]
                                                                                               )).json()}
            best = max(scores, key=scores.__getitem__)
            assert client.post("/bind", json=bind_body(pod, best)).json() == {"Error": ""}
            landed.append((best, plans(client)[pod["metadata"]["name"]]["containers"]["main"]))
    # GPU 6 (3 of 4 used) fills first, never over-packed, then GPU 5; the idle NVSwitch node stays whole
    assert landed == [("busy", ["GPU6"]), ("busy", ["GPU5"]), ("busy", ["GPU5"])]


def test_whole_gpu_pods_never_get_shared_gpus(standalone) -> None:
    nodes = [{"name": "mixed", "topology": DGX1, "sharing": sharing_block(4, [0, 1, 2, 3])}]
    with standalone(nodes) as (_, client):
        five = client.post("/filter", json=cache_args(pod_json("five", 5), ["mixed"])).json()
        four = pod_json("four", 4)
        client.post("/filter", json=cache_args(four, ["mixed"]))
        assert client.post("/bind", json=bind_body(four, "mixed")).json() == {"Error": ""}
        plan = plans(client)["four"]
    assert five["FailedAndUnresolvableNodes"] == {"mixed": "needs 5 GPUs, node has 4 in total"}
    assert plan["resource"] == GPU and sorted(plan["containers"]["main"]) == ["GPU4", "GPU5", "GPU6", "GPU7"]


def test_the_configured_resource_shared_on_some_nodes_takes_replicas_there_and_whole_gpus_elsewhere(
        standalone) -> None:
    nodes = [{"name": "ts", "topology": DGX1, "sharing": sharing_block(2, name=GPU)},
             {"name": "plain", "topology": DGX1}]
    with standalone(nodes) as (_, client):
        pods = [pod_json("a", 2), pod_json("b", 2)]
        for pod, node in zip(pods, ["ts", "plain"], strict=True):
            out = client.post("/filter", json=cache_args(pod, ["ts", "plain"])).json()
            assert out["NodeNames"] == ["ts", "plain"]
            assert client.post("/bind", json=bind_body(pod, node)).json() == {"Error": ""}
        shared = inventory_shared(client, "ts")[GPU]
        whole = next(n for n in client.get("/inventory").json()["nodes"] if n["name"] == "plain")
    assert sum(u for _, _, u in shared) == 2 and max(u for _, _, u in shared) == 1  # two distinct GPUs
    assert len(whole["used"]) == 2


def test_several_replicas_rank_nodes_by_the_ring_they_would_get(standalone) -> None:
    nodes = [{"name": "pcie", "topology": PCIE, "sharing": sharing_block(4)},
             {"name": "nvswitch", "topology": A100, "sharing": sharing_block(4)},
             {"name": "nvswitch-busy", "topology": A100, "sharing": sharing_block(4, used={i: 3 for i in range(8)})}]
    names = [n["name"] for n in nodes]
    pod = shared_pod(4)
    with standalone(nodes) as (_, client):
        scores = {s["Host"]: s["Score"] for s in client.post("/prioritize", json=cache_args(pod, names)).json()}
    # the idle NVSwitch node's ring is the fastest; the busy one's is shared with 3 pods per GPU (a quarter of it)
    assert scores["nvswitch"] == 10 and scores["nvswitch"] > scores["nvswitch-busy"]
    assert scores["nvswitch"] > scores["pcie"]


def test_full_node_list_bodies_read_the_sharing_from_the_nodes_themselves(standalone) -> None:
    a = topo(A100)
    item = node_item("listed", {f"{PREFIX}/topology": topology_to_json(a),
                                f"{PREFIX}/state": shared_state(a, 2, {0: 2, 1: 1}, range(2))})
    with standalone([]) as (_, client):
        two = client.post("/filter", json=list_args(shared_pod(2), [item])).json()
        one = shared_pod(1)
        assert client.post("/filter", json=list_args(one, [item])).json()["NodeNames"] is None  # NodeList mode
        scores = client.post("/prioritize", json=list_args(one, [item])).json()
    assert two["FailedNodes"] == {"listed": f"needs 2 replicas of {SHARED} on 2 distinct GPUs, 1 GPU with a free "
                                            "one: GPU 0 full"}
    assert [n["metadata"]["name"] for n in two["Nodes"]["items"]] == []
    assert scores == [{"Host": "listed", "Score": 10}]


def test_the_example_inventory_shares_gpus() -> None:
    """examples/inventory.yaml (the README's standalone example) places a replica on its shared node."""
    pod = shared_pod(1)
    with running(Extender.standalone(REPO / "examples" / "inventory.yaml")) as client:
        names = [n["name"] for n in client.get("/inventory").json()["nodes"]]
        out = client.post("/filter", json=cache_args(pod, names)).json()
        assert out["NodeNames"] == ["dgx1-v100-shared"]
        assert client.post("/bind", json=bind_body(pod, "dgx1-v100-shared")).json() == {"Error": ""}
        assert plans(client)["infer"]["containers"]["main"] == ["GPU6"]  # the GPU already shared


def test_a_finished_pod_gives_its_replica_back_and_shared_victims_free_no_whole_gpu(standalone) -> None:
    nodes = [{"name": "dgx", "topology": DGX1, "used": [0, 1, 2], "sharing": sharing_block(1, [4, 5, 6, 7])}]
    with standalone(nodes) as (_, client):
        pods = [shared_pod(1, name=f"s{i}") for i in range(4)]
        for pod in pods:
            client.post("/filter", json=cache_args(pod, ["dgx"]))
            assert client.post("/bind", json=bind_body(pod, "dgx")).json() == {"Error": ""}
        assert [u for _, _, u in inventory_shared(client, "dgx")[SHARED]] == [1, 1, 1, 1]
        fifth = shared_pod(1, name="s4")
        assert client.post("/filter", json=cache_args(fifth, ["dgx"])).json()["FailedNodes"]["dgx"].startswith(
            f"needs 1 replica of {SHARED}, 0 GPUs with a free one: GPU 4-7 full")
        assert client.delete(f"/inventory/pods/{pods[0]['metadata']['uid']}").status_code == 200
        assert sum(u for _, _, u in inventory_shared(client, "dgx")[SHARED]) == 3
        assert client.post("/filter", json=cache_args(fifth, ["dgx"])).json()["NodeNames"] == ["dgx"]
        # evicting the replica holders frees no whole GPU: a 2-GPU pod has only GPU 3 whole, so no victims kept
        body = recorded("preempt-nodecache.json")
        body["Pod"] = pod_json("whole", 2)
        body["NodeNameToMetaVictims"] = {"dgx": {"NumPDBViolations": 0, "Pods": [{"UID": p["metadata"]["uid"]}
                                                                                 for p in pods[1:]]}}
        assert client.post("/preempt", json=body).json() == {"NodeNameToMetaVictims": {}}


def test_inventory_sharing_errors_name_the_field(tmp_path) -> None:
    base = {"name": "n", "topology": str(DGX1)}
    for block, needle in (({"strategy": "time-slicing", "resources": [{"name": SHARED, "replicas": 0}]},
                           "replicas must be an integer from 1"),
                          ({"strategy": "slicing", "resources": [{"name": SHARED, "replicas": 2}]}, "strategy"),
                          (sharing_block(2, [0], {1: 1}), "used names GPUs it does not share"),
                          (sharing_block(2, [9]), "GPU index 9 is outside"),
                          ({"resources": [], "extra": 1}, "unknown keys ['extra']")):
        with pytest.raises(InventoryError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            parse_inventory({"nodes": [{**base, "sharing": block}]}, tmp_path)
    with pytest.raises(InventoryError, match="shared GPU as used whole"):
        parse_inventory({"nodes": [{**base, "used": [0], "sharing": sharing_block(2, [0])}]}, tmp_path)


# -- cluster mode (the fake apiserver) --------------------------------------------------------------------------------


def shared_state(t: Topology, replicas: int, used: dict[int, int], gpus: range | list[int], generation: int = 1,
                 one_per_pod: bool = False) -> str:
    """The plugin's state annotation for GPUs `gpus` of `t` shared as SHARED (contract's codec)."""
    entries = tuple(SharedGpu(t.gpus[i].id, replicas, used.get(i, 0)) for i in gpus)
    sharing = Sharing("time-slicing", one_per_pod, (SharedResource(SHARED, entries),))
    return state_to_json(NodeState(generation, frozenset(), frozenset(), sharing))


def shared_node(name: str, t: Topology, replicas: int, used: dict[int, int], gpus: range | list[int]
                ) -> dict[str, Any]:
    return k8s_node(name, t, annotations={f"{PREFIX}/state": shared_state(t, replicas, used, gpus)})


def k8s_shared_pod(name: str, n: int) -> dict[str, Any]:
    pod = k8s_pod(name, 0)
    pod["spec"]["containers"][0]["resources"] = {"limits": {SHARED: str(n)}, "requests": {SHARED: str(n)}}
    return pod


def test_cluster_bind_writes_parent_gpus_reserves_replicas_and_explains(fake: FakeKubeApi, api) -> None:
    a = topo(A100)
    fake.add_node(shared_node("n1", a, 3, {3: 1}, range(4)))
    p1, p2 = fake.add_pod(k8s_shared_pod("p1", 1)), fake.add_pod(k8s_shared_pod("p2", 1))
    with cluster(api) as (ext, client):
        assert filter_names(client, p1, ["n1"])["NodeNames"] == ["n1"]
        assert client.post("/bind", json=bind_body(p1, "n1")).json() == {"Error": ""}
        ann = fake.pod("default", "p1")["metadata"]["annotations"]
        plan = parse_plan(ann[PLAN])
        assert plan.resource == SHARED and plan.ids == {"GPU3"}
        assert ann[PLACEMENT] == (f"n1 GPU 3: a replica of {SHARED} (time-slicing); shares GPU 3 with 1 pod, "
                                  "2 of 3 replicas used")
        assert [r.replicas for r in ext.reservations.all()] == [(("GPU3", 2),)]
        assert client.post("/bind", json=bind_body(p2, "n1")).json() == {"Error": ""}
        assert parse_plan(fake.pod("default", "p2")["metadata"]["annotations"][PLAN]).ids == {"GPU3"}
        # GPU 3 is now full (1 published + 2 in flight): a third pod goes to another GPU
        p3 = fake.add_pod(k8s_shared_pod("p3", 1))
        assert client.post("/bind", json=bind_body(p3, "n1")).json() == {"Error": ""}
        assert parse_plan(fake.pod("default", "p3")["metadata"]["annotations"][PLAN]).ids != {"GPU3"}
        # the plugin publishes p1 and p2 admitted on GPU 3: those two settle, p3's stays
        fake.update_node("n1", {"metadata": {"annotations": {f"{PREFIX}/state": shared_state(a, 3, {3: 3}, range(4),
                                                                                              2)}}})
        assert ext.cache.wait_for(lambda: ext.reservations.count() == 1, 10)
        assert ext.reservations.all()[0].name == "p3"


def test_concurrent_shared_binds_never_over_book_a_gpu_and_survive_a_restart(fake: FakeKubeApi, api) -> None:
    d, a = topo(DGX1), topo(A100)
    names = [f"n{i}" for i in range(4)]
    for i, name in enumerate(names):  # 4 nodes x 4 shared GPUs x 3 replicas = 48 replicas, some already used
        fake.add_node(shared_node(name, d if i % 2 else a, 3, {0: 2, 1: 1}, range(4)))
    sizes = [1, 1, 2, 3]
    pods = [fake.add_pod(k8s_shared_pod(f"p{i}", sizes[i % 4])) for i in range(60)]

    def bind_all(client: httpx.Client, batch: list[dict[str, Any]], offset: int) -> list[str]:
        with thread_clients(client.base_url) as mine, ThreadPoolExecutor(16) as pool:
            return list(pool.map(lambda k: mine().post("/bind", json=bind_body(
                batch[k], names[(k + offset) % 4])).json()["Error"], range(len(batch))))

    with cluster(api) as (_, client):
        first = bind_all(client, pods[:30], 0)
    with cluster(api) as (ext, client):  # restart with every plan in flight: nothing is published used
        assert ext.reservations.count() == first.count("")
        second = bind_all(client, pods[30:], 1)
    errors = first + second
    assert all("cannot take pod" in e for e in errors if e), [e for e in errors if e][:3]
    held: Counter[tuple[str, str]] = Counter({(n, "GPU0"): 2 for n in names} | {(n, "GPU1"): 1 for n in names})
    bound = 0
    for p in fake.pods():
        text = (p["metadata"].get("annotations") or {}).get(PLAN)
        if not text:
            continue
        plan = parse_plan(text)
        ids = plan.container_ids()["main"]
        assert len(ids) == len(set(ids)) == int(p["spec"]["containers"][0]["resources"]["limits"][SHARED])
        held.update((plan.node, g) for g in ids)
        bound += 1
    assert bound == errors.count("") > 20
    assert max(held.values()) == 3  # no GPU past its replicas
    assert set(g for _, g in held) <= {"GPU0", "GPU1", "GPU2", "GPU3"}


# -- the choice against exhaustive search -----------------------------------------------------------------------------

TOPOLOGIES = [topo(DGX1), topo(A100), topo(PCIE)]


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2), st.lists(st.tuples(st.integers(2, 4), st.integers(0, 4)), min_size=8, max_size=8),
       st.integers(1, 5), st.sets(st.integers(0, 7), max_size=2))
def test_choice_is_k_distinct_gpus_with_a_free_replica_and_the_best_ring(which: int, per_gpu: list[tuple[int, int]],
                                                                        k: int, unhealthy: set[int]) -> None:
    t = TOPOLOGIES[which]
    entries = tuple(SharedGpu(t.gpus[i].id, rep, min(rep, u)) for i, (rep, u) in enumerate(per_gpu))
    sharing = Sharing("mps", False, (SharedResource(SHARED, entries),))
    index = {g.id: g.index for g in t.gpus}
    view = node_sharing(sharing, index)[0]
    entry = make_entry("n", t, unhealthy=[t.gpus[i].id for i in unhealthy], sharing=view)
    pending = {t.gpus[0].id: 1}  # one replica of GPU 0 in flight
    used = {i: min(rep, u) + (1 if i == 0 else 0) for i, (rep, u) in enumerate(per_gpu)}
    free = [i for i, (rep, _) in enumerate(per_gpu) if used[i] < rep and i not in unhealthy]
    got = shared_choice(entry, SHARED, k, pending, k)
    if len(free) < k:
        assert isinstance(got, Failed) and not isinstance(got, Unresolvable)
        return
    assert isinstance(got, SharedChoice)
    assert len(set(got.gpus)) == k and set(got.gpus) <= set(free)
    if k == 1:
        busy = [i for i in free if used[i] > 0]
        if busy:
            assert used[got.gpus[0]] == max(used[i] for i in busy)
        return
    # what the pod will see: the ring over 1 + the most other pods on one of its GPUs, best of every k-subset
    best = max(allreduce_gbps(t, c) / (1 + max(used[g] for g in c)) for c in itertools.combinations(free, k))
    assert got.effective_gbps == pytest.approx(best)
    assert got.gbps == pytest.approx(allreduce_gbps(t, got.gpus))


def test_state_json_round_trip_feeds_the_cache(fake: FakeKubeApi, api) -> None:
    """A node's published sharing reaches the cache as the contract writes it (no GPU of it offered whole)."""
    a = topo(A100)
    fake.add_node(shared_node("n1", a, 2, {}, [0, 1]))
    with cluster(api) as (ext, client):
        entry = ext.cache.nodes["n1"]
        assert entry.total == 6 and SHARED in ext.cache.shared_names
        out = filter_names(client, k8s_pod("w", 7), ["n1"])
    assert out["FailedAndUnresolvableNodes"] == {"n1": "needs 7 GPUs, node has 6 in total"}
