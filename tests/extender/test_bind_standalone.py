"""Bind in standalone mode (inventory, no apiserver): plans, retries, and 1,000 concurrent binds over HTTP."""

from __future__ import annotations

import random
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gputopo.core import allreduce_gbps
from tests.extender.conftest import A100, DGX1, H100X4, topo
from tests.helpers.clients import thread_clients
from tests.helpers.scheduler import bind_body, cache_args, pod_json


def _plans(client) -> dict[str, dict[str, Any]]:
    return {p["uid"]: p for p in client.get("/inventory").json()["pods"]}


def test_bind_records_a_plan_per_container(standalone) -> None:
    pod = pod_json(containers=[{"name": "a", "gpus": 4}, {"name": "b", "gpus": 4}],
                   init_containers=[{"name": "setup", "gpus": 2}])
    with standalone([{"name": "dgx", "topology": DGX1}]) as (_, client):
        client.post("/filter", json=cache_args(pod, ["dgx"]))
        assert client.post("/bind", json=bind_body(pod, "dgx")).json() == {"Error": ""}
        plan = _plans(client)[pod["metadata"]["uid"]]["plan"]
        node = client.get("/inventory").json()["nodes"][0]
    assert plan["v"] == 1 and plan["node"] == "dgx" and plan["resource"] == "nvidia.com/gpu"
    c = plan["containers"]
    assert sorted([sorted(c["a"]), sorted(c["b"])]) == [["GPU0", "GPU1", "GPU2", "GPU3"],
                                                          ["GPU4", "GPU5", "GPU6", "GPU7"]]
    assert set(c["setup"]) <= set(c["a"])
    assert plan["gbps"] == allreduce_gbps(topo(DGX1), range(8))  # the estimate of the union
    assert node["free"] == [] and len(node["used"]) == 8


def test_retried_bind_is_consistent_and_other_nodes_are_refused(standalone) -> None:
    pod = pod_json(gpus=2)
    nodes = [{"name": "a", "topology": A100}, {"name": "b", "topology": A100}]
    with standalone(nodes) as (_, client):
        client.post("/filter", json=cache_args(pod, ["a", "b"]))
        assert client.post("/bind", json=bind_body(pod, "a")).json() == {"Error": ""}
        first = _plans(client)
        assert client.post("/bind", json=bind_body(pod, "a")).json() == {"Error": ""}
        assert _plans(client) == first  # the same plan, nothing more used
        other = client.post("/bind", json=bind_body(pod, "b")).json()["Error"]
        metrics = client.get("/metrics").text
    assert other == f"pod default/{pod['metadata']['name']} is already bound to node a, not b"
    assert 'gpu_extender_bind_total{outcome="already_bound"} 1.0' in metrics
    assert 'gpu_extender_plan_efficiency_ratio_count 1.0' in metrics


def test_a_pod_without_gpus_is_bound_once_like_a_gpu_pod(standalone) -> None:
    pod = pod_json(gpus=0)
    nodes = [{"name": "a", "topology": A100}, {"name": "b", "topology": A100}]
    with standalone(nodes) as (_, client):
        client.post("/filter", json=cache_args(pod, ["a", "b"]))
        assert client.post("/bind", json=bind_body(pod, "a")).json() == {"Error": ""}
        assert client.post("/bind", json=bind_body(pod, "a")).json() == {"Error": ""}  # a retry
        other = client.post("/bind", json=bind_body(pod, "b")).json()["Error"]
        pods = _plans(client)
        nodes_now = client.get("/inventory").json()["nodes"]
    assert other == f"pod default/{pod['metadata']['name']} is already bound to node a, not b"
    assert pods[pod["metadata"]["uid"]]["node"] == "a" and pods[pod["metadata"]["uid"]]["plan"] is None
    assert all(n["used"] == [] for n in nodes_now)


def test_bind_errors_are_answered_in_the_body(standalone) -> None:
    nodes = [{"name": "small", "topology": H100X4, "used": [0, 1]}]
    with standalone(nodes) as (_, client):
        stranger = pod_json(gpus=1)
        unknown = client.post("/bind", json=bind_body(stranger, "small")).json()["Error"]
        big = pod_json(gpus=3)
        client.post("/filter", json=cache_args(big, ["small"]))
        no_fit = client.post("/bind", json=bind_body(big, "small")).json()["Error"]
        ghost = client.post("/bind", json=bind_body(big, "ghost")).json()["Error"]
    assert "never seen by /filter" in unknown
    name = big["metadata"]["name"]
    assert no_fit == f"node small cannot take pod default/{name}: needs 3 GPUs, 2 free: GPU 0,1 in use"
    assert "unknown to the GPU extender" in ghost


def test_release_frees_the_gpus(standalone) -> None:
    pod = pod_json(gpus=8)
    with standalone([{"name": "a", "topology": A100}]) as (_, client):
        client.post("/filter", json=cache_args(pod, ["a"]))
        client.post("/bind", json=bind_body(pod, "a"))
        assert client.post("/filter", json=cache_args(pod_json(gpus=1), ["a"])).json()["NodeNames"] == []
        r = client.delete(f"/inventory/pods/{pod['metadata']['uid']}")
        assert r.status_code == 200 and len(r.json()["released"]) == 8
        assert client.delete(f"/inventory/pods/{pod['metadata']['uid']}").status_code == 404
        assert client.post("/filter", json=cache_args(pod_json(gpus=8), ["a"])).json()["NodeNames"] == ["a"]


def test_1000_concurrent_binds_on_100_nodes_never_share_a_gpu(standalone) -> None:
    nodes = [{"name": "a100", "topology": A100, "replicas": 50}, {"name": "dgx", "topology": DGX1, "replicas": 50}]
    names = [f"a100-{i}" for i in range(50)] + [f"dgx-{i}" for i in range(50)]
    rng = random.Random(7)
    pods = [pod_json(f"p{i}", gpus=rng.choice([1, 1, 2, 4])) for i in range(1000)]
    with standalone(nodes) as (_, client), thread_clients(client.base_url) as mine:

        def one(k: int) -> str:
            pod = pods[k]
            candidates = rng.sample(names, 3)
            ok = mine().post("/filter", json=cache_args(pod, candidates)).json()["NodeNames"]
            target = ok[0] if ok else candidates[0]
            return mine().post("/bind", json=bind_body(pod, target)).json()["Error"]

        with ThreadPoolExecutor(32) as pool:
            errors = list(pool.map(one, range(1000)))
        plans = _plans(client)
        inventory = client.get("/inventory").json()["nodes"]
    bound = [e for e in errors if e == ""]
    assert len(bound) == len(plans) > 300
    assert all("cannot take pod" in e for e in errors if e)
    taken = Counter((p["node"], g) for p in plans.values() for ids in p["plan"]["containers"].values() for g in ids)
    assert taken and max(taken.values()) == 1  # zero GPUs assigned twice
    used = {(n["name"], g) for n in inventory for g in n["used"]}
    assert used == set(taken)  # the inventory agrees with the plans
    by_uid = {p["metadata"]["uid"]: p for p in pods}
    for uid, p in plans.items():
        want = int(by_uid[uid]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
        assert len(p["plan"]["containers"]["main"]) == want


def test_decimal_exponent_quantities_are_placed(standalone) -> None:
    """Issue 14, item 3: "8e0" is 8 GPUs, "2e0" two, on the extender's path as on the plugin's (gputopo.quantity)."""
    pod = pod_json(containers=[{"name": "a", "gpus": "2e0"}, {"name": "b", "gpus": "6e0"}])
    with standalone([{"name": "a100", "topology": A100}]) as (_, client):
        out = client.post("/filter", json=cache_args(pod, ["a100"])).json()
        assert out["Error"] == "" and out["NodeNames"] == ["a100"]
        assert client.post("/bind", json=bind_body(pod, "a100")).json() == {"Error": ""}
        plan = _plans(client)[pod["metadata"]["uid"]]["plan"]["containers"]
    assert len(plan["a"]) == 2 and len(plan["b"]) == 6


def test_repeated_container_names_are_refused_and_nothing_is_reserved(standalone) -> None:
    """Issue 14, item 4: two containers named alike, 2 GPUs each, would count 4 but share one part of a plan."""
    pod = pod_json(containers=[{"name": "worker", "gpus": 2}, {"name": "worker", "gpus": 2}])
    with standalone([{"name": "a100", "topology": A100}]) as (_, client):
        out = client.post("/filter", json=cache_args(pod, ["a100"])).json()
        bound = client.post("/bind", json=bind_body(pod, "a100")).json()["Error"]
        inventory = client.get("/inventory").json()
    assert out["NodeNames"] == [] and "repeats the container name 'worker'" in out["Error"]
    assert bound  # refused: never seen as a valid pod
    assert inventory["pods"] == [] and len(inventory["nodes"][0]["free"]) == 8
