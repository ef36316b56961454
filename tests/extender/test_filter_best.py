"""--filter-best: filter passes only the nodes prioritize would score best, so kube-scheduler can leave prioritize
out of its configuration (one round trip per pod). The answer must be exactly the top of prioritize's own scores,
ties kept, and the placement explanation of the bind that follows must still compare against the best offer."""

from __future__ import annotations

from typing import Any

import pytest

from tests.extender.conftest import A100, DGX1, PCIE
from tests.helpers.scheduler import bind_body, cache_args, pod_json

NODES: list[dict[str, Any]] = [
    {"name": "pcie", "topology": PCIE},
    {"name": "nvswitch-a", "topology": A100},
    {"name": "cube", "topology": DGX1, "used": [0, 1, 2, 3]},
    {"name": "nvswitch-b", "topology": A100, "used": [0]},
]


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_filter_passes_exactly_the_top_of_prioritizes_scores(standalone, gpus: int) -> None:
    pod = pod_json(gpus=gpus)
    names = [n["name"] for n in NODES]
    with standalone(NODES) as (_, plain):
        passed = plain.post("/filter", json=cache_args(pod, names)).json()["NodeNames"]
        scores = {h["Host"]: h["Score"] for h in plain.post("/prioritize", json=cache_args(pod, passed)).json()}
    with standalone(NODES, filter_best=True) as (_, best):
        answer = best.post("/filter", json=cache_args(pod, names)).json()
    top = max(scores.values())
    assert sorted(answer["NodeNames"]) == sorted(n for n, s in scores.items() if s == top)
    assert len(answer["NodeNames"]) < len(passed) or len(set(scores.values())) == 1
    assert not set(answer["FailedNodes"]) & set(passed)  # the others are fine, not failed


def test_a_bind_after_a_narrowed_filter_plans_the_best_set_and_explains_it(standalone) -> None:
    pod = pod_json(gpus=4)
    with standalone(NODES, filter_best=True) as (_, client):
        (node,) = set(client.post("/filter", json=cache_args(pod, [n["name"] for n in NODES])).json()["NodeNames"])
        assert node.startswith("nvswitch")
        assert client.post("/bind", json=bind_body(pod, node)).json() == {"Error": ""}
        placed = next(p for p in client.get("/inventory").json()["pods"] if p["uid"] == pod["metadata"]["uid"])
    assert placed["plan"]["node"] == node and len(placed["plan"]["containers"]["main"]) == 4


def test_a_pod_that_fits_nowhere_still_gets_every_reason(standalone) -> None:
    pod = pod_json(gpus=16)
    with standalone(NODES, filter_best=True) as (_, client):
        answer = client.post("/filter", json=cache_args(pod, [n["name"] for n in NODES])).json()
    assert answer["NodeNames"] == [] and set(answer["FailedNodes"]) | set(
        answer.get("FailedAndUnresolvableNodes") or {}) == {n["name"] for n in NODES}
