"""Preempt keeps a node's victims only when evicting them frees a GPU subset the pod can use."""

from __future__ import annotations

import copy
import json
from typing import Any

from tests.extender.conftest import A100, DGX1, PCIE
from tests.helpers.scheduler import bind_body, cache_args, pod_json, recorded

NVLINK = "gpu-topology.io/require-nvlink"


def _bind(client, pod: dict[str, Any], node: str) -> None:
    client.post("/filter", json=cache_args(pod, [node]))
    assert client.post("/bind", json=bind_body(pod, node)).json() == {"Error": ""}


def _meta_body(pod: dict[str, Any], victims: dict[str, list[str]]) -> dict[str, Any]:
    body = recorded("preempt-nodecache.json")
    body["Pod"] = pod
    body["NodeNameToMetaVictims"] = {n: {"NumPDBViolations": 1, "Pods": [{"UID": u} for u in uids]}
                                     for n, uids in victims.items()}
    return body


def test_meta_victims_are_kept_only_where_eviction_frees_a_suitable_subset(standalone) -> None:
    nodes = [{"name": "full", "topology": A100},
             {"name": "no-plans", "topology": A100, "used": list(range(8))},
             {"name": "dgx", "topology": DGX1}]
    with standalone(nodes) as (_, client):
        a, b = pod_json("a", 4), pod_json("b", 4)
        _bind(client, a, "full")
        _bind(client, b, "full")
        # dgx: d1 and d2 take one NVLink quad each; d1 ends; d3 takes 2 GPUs of the freed quad
        d1, d2, d3 = pod_json("d1", 4), pod_json("d2", 4), pod_json("d3", 2)
        _bind(client, d1, "dgx")
        _bind(client, d2, "dgx")
        client.delete(f"/inventory/pods/{d1['metadata']['uid']}")
        _bind(client, d3, "dgx")
        dgx_free = next(n for n in client.get("/inventory").json()["nodes"] if n["name"] == "dgx")["free"]
        assert len(dgx_free) == 2
        ghost = "uid-of-a-pod-the-extender-never-placed"

        new = pod_json("new", 4, annotations={NVLINK: "true"})
        out = client.post("/preempt", json=_meta_body(new, {
            "full": [a["metadata"]["uid"]],  # frees 4 NVSwitch GPUs: kept
            "no-plans": [ghost],  # GPUs of unknown victims free nothing as far as we know: dropped
            "dgx": [d3["metadata"]["uid"]],  # d3's 2 GPUs + the 2 free = the whole quad, an NVLink ring: kept
            "ghost-node": [a["metadata"]["uid"]],  # not a node we know: dropped
        })).json()
    assert out == {"NodeNameToMetaVictims": {
        "full": {"Pods": [{"UID": a["metadata"]["uid"]}], "NumPDBViolations": 1},
        "dgx": {"Pods": [{"UID": d3["metadata"]["uid"]}], "NumPDBViolations": 1}}}


def test_full_pod_victims_read_the_plan_from_the_victim(standalone) -> None:
    nodes = [{"name": "n", "topology": A100}]
    with standalone(nodes) as (_, client):
        v = pod_json("v", 8)
        _bind(client, v, "n")
        plan = client.get("/inventory").json()["pods"][0]["plan"]
        body = recorded("preempt.json")
        victim = copy.deepcopy(body["NodeNameToVictims"]["gpu-node-5"]["Pods"][0])
        victim["metadata"]["uid"] = "fresh-uid-only-in-this-body"
        victim["metadata"]["annotations"] = {"gpu-topology.io/plan": json.dumps(plan)}
        body["Pod"] = pod_json("new", 8)
        body["NodeNameToVictims"] = {"n": {"NumPDBViolations": 0, "Pods": [victim]}}
        kept = client.post("/preempt", json=body).json()
        victim["metadata"]["annotations"] = {}
        dropped = client.post("/preempt", json=body).json()
    assert kept == {"NodeNameToMetaVictims": {"n": {"Pods": [{"UID": "fresh-uid-only-in-this-body"}],
                                                    "NumPDBViolations": 0}}}
    assert dropped == {"NodeNameToMetaVictims": {}}


def test_equal_victim_costs_keep_only_the_fastest_subset(standalone) -> None:
    """Issue 14, item 6: an 8-GPU pod, two victims of one priority on a PCIe node and on an NVSwitch node: only the
    NVSwitch node is offered, so kube-scheduler's pick cannot land on 14 GB/s. Cheaper victims stay offered."""
    nodes = [{"name": "pcie", "topology": PCIE}, {"name": "nvswitch", "topology": A100}]
    with standalone(nodes) as (_, client):
        victims: dict[str, list[dict[str, Any]]] = {"pcie": [], "nvswitch": []}
        for node in victims:
            for i in range(2):
                pod = pod_json(f"{node}-{i}", 4)
                _bind(client, pod, node)
                victims[node].append(pod)
        plans = {p["uid"]: p["plan"] for p in client.get("/inventory").json()["pods"]}
        template = recorded("preempt.json")["NodeNameToVictims"]["gpu-node-5"]["Pods"][0]

        def full(pod: dict[str, Any], priority: int) -> dict[str, Any]:
            v = copy.deepcopy(template)
            v["metadata"]["uid"] = pod["metadata"]["uid"]
            v["metadata"]["annotations"] = {"gpu-topology.io/plan": json.dumps(plans[pod["metadata"]["uid"]])}
            v["spec"]["priority"] = priority
            return v

        def preempt(pcie_priority: int) -> dict[str, Any]:
            body = recorded("preempt.json")
            body["Pod"] = pod_json("urgent", 8)
            body["NodeNameToVictims"] = {
                "pcie": {"NumPDBViolations": 0, "Pods": [full(p, pcie_priority) for p in victims["pcie"]]},
                "nvswitch": {"NumPDBViolations": 0, "Pods": [full(p, 100) for p in victims["nvswitch"]]}}
            return client.post("/preempt", json=body).json()["NodeNameToMetaVictims"]

        same_cost = preempt(100)
        cheaper_on_pcie = preempt(10)
    assert list(same_cost) == ["nvswitch"]
    assert sorted(cheaper_on_pcie) == ["nvswitch", "pcie"]  # different costs: kube-scheduler weighs those
