"""Filter and prioritize decisions on real topologies, over HTTP (standalone inventory)."""

from __future__ import annotations

from typing import Any

from tests.extender.conftest import A100, DGX1, H100X4, PCIE
from tests.helpers.scheduler import bind_body, cache_args, pod_json

NVLINK = "gpu-topology.io/require-nvlink"
MIN_GBPS = "gpu-topology.io/min-allreduce-gbps"


def _filter(client, pod: dict[str, Any], names: list[str]) -> dict[str, Any]:
    r = client.post("/filter", json=cache_args(pod, names))
    assert r.status_code == 200
    return r.json()


def _scores(client, pod: dict[str, Any], names: list[str]) -> dict[str, int]:
    r = client.post("/prioritize", json=cache_args(pod, names))
    assert r.status_code == 200
    return {h["Host"]: h["Score"] for h in r.json()}


def test_filter_reasons_name_the_gpus(standalone) -> None:
    nodes = [{"name": "a", "topology": A100, "used": ["GPU0", "GPU1"], "unhealthy": ["GPU5"]},
             {"name": "small", "topology": H100X4},
             {"name": "cordoned", "topology": A100, "unschedulable": True}]
    with standalone(nodes) as (_, client):
        out = _filter(client, pod_json(gpus=6), ["a", "small", "cordoned"])
        ok = _filter(client, pod_json(gpus=5), ["a"])
    assert out["NodeNames"] == []
    assert out["FailedNodes"] == {"a": "needs 6 GPUs, 5 free: GPU 0,1 in use, GPU 5 unhealthy"}
    assert out["FailedAndUnresolvableNodes"] == {"small": "needs 6 GPUs, node has 4 in total",
                                                 "cordoned": "node is cordoned (spec.unschedulable)"}
    assert ok["NodeNames"] == ["a"]


def test_require_nvlink(standalone) -> None:
    nodes = [{"name": "pcie", "topology": PCIE},
             {"name": "dgx-frag", "topology": DGX1, "used": [0, 2, 5, 7]},  # free 1,3,4,6: no NVLink ring of 4
             {"name": "dgx", "topology": DGX1}]
    with standalone(nodes) as (_, client):
        out = _filter(client, pod_json(gpus=4, annotations={NVLINK: "true"}), ["pcie", "dgx-frag", "dgx"])
        off = _filter(client, pod_json(gpus=4, annotations={NVLINK: "false"}), ["pcie", "dgx-frag", "dgx"])
        one = _filter(client, pod_json(gpus=1, annotations={NVLINK: "true"}), ["pcie"])
    assert out["NodeNames"] == ["dgx"]
    assert out["FailedAndUnresolvableNodes"]["pcie"].startswith("requires NVLink")
    assert out["FailedNodes"]["dgx-frag"].startswith("requires an NVLink ring of 4 GPUs: the best free ones")
    assert off["NodeNames"] == ["pcie", "dgx-frag", "dgx"]
    assert one["NodeNames"] == ["pcie"]  # one GPU needs no links


def test_min_allreduce_gbps(standalone) -> None:
    nodes = [{"name": "a100", "topology": A100}, {"name": "pcie", "topology": PCIE},
             {"name": "h100", "topology": H100X4, "used": [0]}]
    with standalone(nodes) as (_, client):
        out = _filter(client, pod_json(gpus=2, annotations={MIN_GBPS: "100"}), ["a100", "pcie", "h100"])
        high = _filter(client, pod_json(gpus=4, annotations={MIN_GBPS: "300"}), ["a100"])
    assert out["NodeNames"] == ["a100", "h100"]
    assert "even when empty" in out["FailedAndUnresolvableNodes"]["pcie"]
    assert high["NodeNames"] == [] and "240.0 GB/s even when empty" in high["FailedAndUnresolvableNodes"]["a100"]


def test_better_interconnect_scores_higher_than_tighter_fit_while_islands_are_plentiful(standalone) -> None:
    from extender.config import DEFAULT_ISLAND_SPARE

    whole = [{"name": f"a100-{k}", "topology": A100} for k in range(DEFAULT_ISLAND_SPARE + 1)]
    nodes = [*whole, {"name": "pcie-tight", "topology": PCIE, "used": [0, 1, 2, 3]}]
    names = ["pcie-tight", *(n["name"] for n in whole)]
    with standalone(nodes) as (_, client):
        s = _scores(client, pod_json(gpus=4), names)
    assert s["a100-0"] == 10 and s["pcie-tight"] < s["a100-0"]


def test_one_of_the_last_whole_nvswitch_nodes_is_kept_for_a_larger_pod(standalone) -> None:
    """Breaking a scarce 8-GPU NVSwitch island for a 4-GPU pod costs that island's GB/s: the pod takes a tighter
    node, and the island stays whole for the 8-GPU pod that only it can serve well. Penalty 0 is greedy."""
    nodes = [{"name": "a100", "topology": A100}, {"name": "pcie-tight", "topology": PCIE, "used": [0, 1, 2, 3]}]
    with standalone(nodes) as (_, client):
        s = _scores(client, pod_json(gpus=4), ["pcie-tight", "a100"])
    assert s["pcie-tight"] > s["a100"]
    with standalone(nodes, island_penalty=0.0) as (_, client):
        greedy = _scores(client, pod_json(gpus=4), ["pcie-tight", "a100"])
    assert greedy["a100"] > greedy["pcie-tight"]


def test_single_gpu_goes_to_the_tightest_node_not_a_whole_free_island(standalone) -> None:
    nodes = [{"name": "empty", "topology": A100},
             {"name": "one-left", "topology": A100, "used": [0, 1, 2, 3, 4, 5, 6]},
             {"name": "half", "topology": A100, "used": [0, 1, 2, 3]}]
    with standalone(nodes) as (_, client):
        s = _scores(client, pod_json(gpus=1), ["empty", "one-left", "half"])
    assert s["one-left"] > s["half"] > s["empty"]


def test_four_gpus_prefer_the_node_with_exactly_four_free(standalone) -> None:
    nodes = [{"name": "empty", "topology": A100}, {"name": "four-free", "topology": A100, "used": [0, 1, 2, 3]}]
    with standalone(nodes) as (_, client):
        s = _scores(client, pod_json(gpus=4), ["empty", "four-free"])
    assert s["four-free"] > s["empty"]


def test_pair_keeps_quads_whole_and_uses_a_leftover_pair(standalone) -> None:
    # DGX-1: "pair" has only an NV2 pair free (0,3); "quad" has a whole quad free; "empty" has both quads free.
    nodes = [{"name": "pair", "topology": DGX1, "used": [1, 2, 4, 5, 6, 7]},
             {"name": "quad", "topology": DGX1, "used": [4, 5, 6, 7]},
             {"name": "empty", "topology": DGX1}]
    with standalone(nodes) as (_, client):
        s = _scores(client, pod_json(gpus=2), ["empty", "quad", "pair"])
    assert s["pair"] > s["quad"] > s["empty"]


def test_fragmented_node_scores_below_an_intact_one_of_the_same_model(standalone) -> None:
    nodes = [{"name": "frag", "topology": DGX1, "used": [0, 2, 5, 7]}, {"name": "quad", "topology": DGX1,
                                                                          "used": [4, 5, 6, 7]}]
    with standalone(nodes) as (_, client):
        s = _scores(client, pod_json(gpus=4), ["frag", "quad"])
    assert s["quad"] == 10 and s["frag"] < 6  # a worse ring is a lower band, whatever the packing


def test_nodes_that_do_not_fit_score_zero(standalone) -> None:
    nodes = [{"name": "full", "topology": A100, "used": list(range(8))}, {"name": "free", "topology": A100}]
    with standalone(nodes) as (_, client):
        s = _scores(client, pod_json(gpus=2), ["full", "free", "unknown"])
    assert s == {"full": 0, "free": 10, "unknown": 0}


def test_pods_without_gpus_pass_through(standalone) -> None:
    with standalone([{"name": "a", "topology": A100}]) as (_, client):
        out = _filter(client, pod_json(gpus=0), ["a", "unknown"])
        s = _scores(client, pod_json(gpus=0), ["a", "unknown"])
    assert out["NodeNames"] == ["a", "unknown"] and s == {"a": 0, "unknown": 0}


def test_multi_container_and_init_container_pods_are_counted_as_the_kubelet_does(standalone) -> None:
    nodes = [{"name": "n", "topology": A100, "used": [0, 1, 2]}]  # 5 free
    cases = [
        (pod_json(containers=[{"name": "a", "gpus": 2}, {"name": "b", "gpus": 2}]), 4),  # app containers add up
        (pod_json(containers=[{"name": "a", "gpus": 2}], init_containers=[{"name": "i", "gpus": 6}]), 6),
        (pod_json(containers=[{"name": "a", "gpus": 3}], init_containers=[{"name": "i", "gpus": 2}]), 3),
        # a sidecar runs beside everything started after it: max(1 + init 4, 1 + apps 2+3) = 6
        (pod_json(containers=[{"name": "a", "gpus": 2}, {"name": "b", "gpus": 3}],
                  init_containers=[{"name": "side", "gpus": 1, "sidecar": True}, {"name": "i", "gpus": 4}]), 6),
    ]
    with standalone(nodes) as (_, client):
        for pod, need in cases:
            out = _filter(client, pod, ["n"])
            if need <= 5:
                assert out["NodeNames"] == ["n"], (need, out)
            else:
                assert out["FailedNodes"]["n"].startswith(f"needs {need} GPUs, 5 free"), (need, out)


def test_prioritize_after_a_change_since_its_filter_scores_the_change(standalone) -> None:
    """prioritize over the nodes its filter passed, after one of them changed in between (placement patches its
    last answers by the nodes that changed): the node is scored as it is now, the answer a cold extender gives."""
    nodes = [{"name": "a", "topology": A100}, {"name": "b", "topology": A100}, {"name": "c", "topology": PCIE}]
    pod, other = pod_json("p", gpus=4, uid="uid-p"), pod_json("q", gpus=8, uid="uid-q")
    with standalone(nodes) as (_, client):
        passed = _filter(client, pod, ["a", "b", "c"])["NodeNames"]
        assert passed == ["a", "b", "c"]
        assert _filter(client, other, ["a"])["NodeNames"] == ["a"]
        assert client.post("/bind", json=bind_body(other, "a")).json() == {"Error": ""}  # a is full now
        scores = _scores(client, pod, passed)
    full = [{**nodes[0], "used": [f"GPU{i}" for i in range(8)]}, *nodes[1:]]
    with standalone(full) as (_, cold):
        assert scores == _scores(cold, pod, passed)
    assert scores["a"] == 0 and scores["b"] > 0
