"""Prioritize answered from the scores worked out right after the pod's filter (extender.placement.prepared), over
HTTP: the same answer as computing it, and computed afresh when a node changed or the nodes differ."""

from __future__ import annotations

import re
from typing import Any

from extender.placement.prepared import WINDOW
from tests.extender.conftest import A100, DGX1, H100X4
from tests.helpers.polling import eventually
from tests.helpers.scheduler import bind_body, cache_args, pod_json

NODES = [{"name": "dgx", "topology": DGX1, "used": [0, 5]},
         {"name": "dgx-empty", "topology": DGX1},
         {"name": "a100", "topology": A100, "used": ["GPU2"]},
         {"name": "h100", "topology": H100X4, "used": [3]}]
NAMES = [n["name"] for n in NODES]


def prepared_counts(client: Any) -> dict[str, float]:
    text = client.get("/metrics").text
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^gpu_extender_prioritize_prepared_total\{source="(\w+)"\} (\S+)$', text, re.M)}


def preparations(client: Any) -> float:
    m = re.search(r"^gpu_extender_prioritize_preparations_total (\S+)$", client.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def passed(client: Any, pod: dict[str, Any], names: list[str]) -> list[str]:
    r = client.post("/filter", json=cache_args(pod, names))
    assert r.status_code == 200
    return r.json()["NodeNames"]


def scores(client: Any, pod: dict[str, Any], names: list[str]) -> list[tuple[str, int]]:
    r = client.post("/prioritize", json=cache_args(pod, names))
    assert r.status_code == 200
    return [(h["Host"], h["Score"]) for h in r.json()]


def test_prioritize_after_filter_answers_what_it_would_compute(standalone) -> None:
    with standalone(NODES) as (_, client):
        for gpus in (1, 2, 4):
            fresh = scores(client, pod_json(f"fresh-{gpus}", gpus), NAMES)  # never filtered: computed
            pod = pod_json(f"p-{gpus}", gpus)
            names = passed(client, pod, NAMES)
            assert len(names) > 1
            assert scores(client, pod, names) == [h for h in fresh if h[0] in names]
        counts = prepared_counts(client)
    assert counts.get("prepared") == 3.0 and counts.get("computed") == 3.0
    assert counts.get("changed", 0.0) == 0.0
    assert len({s for _, s in fresh}) > 1  # the nodes are told apart: an all-equal answer would prove nothing


def test_a_node_changed_after_the_filter_is_scored_as_it_is_now(standalone) -> None:
    with standalone(NODES) as (_, client):
        pod = pod_json("late", 4)
        names = passed(client, pod, NAMES)
        assert "dgx-empty" in names
        assert eventually(lambda: preparations(client) == 1.0, 10)  # its answer is prepared: now a node changes
        other = pod_json("first", 4)
        assert passed(client, other, ["dgx-empty"]) == ["dgx-empty"]
        assert client.post("/bind", json=bind_body(other, "dgx-empty")).json()["Error"] == ""  # half of it now used
        now = scores(client, pod, names)
        fresh = scores(client, pod_json("fresh", 4), names)
        counts = prepared_counts(client)
    assert now == fresh
    assert counts.get("changed") == 1.0 and counts.get("prepared", 0.0) == 0.0


def test_other_nodes_than_the_filter_passed_are_computed(standalone) -> None:
    with standalone(NODES) as (_, client):
        pod = pod_json("p", 2)
        names = passed(client, pod, NAMES)
        assert scores(client, pod, names[:-1]) == scores(client, pod_json("fresh", 2), names[:-1])
        counts = prepared_counts(client)
    assert counts.get("computed") == 2.0 and counts.get("prepared", 0.0) == 0.0


def test_a_client_that_never_takes_them_gets_no_more_prepared(standalone) -> None:
    """Preparing costs what computing costs: after WINDOW // 4 answers prepared and never taken (prioritize asked
    for other nodes), the next filter prepares nothing, so even a matching prioritize is computed."""
    with standalone(NODES) as (_, client):
        for k in range(WINDOW // 4):
            pod = pod_json(f"other-{k}", 1)
            names = passed(client, pod, NAMES)
            scores(client, pod, names[:-1])
        pod = pod_json("matching", 1)
        assert scores(client, pod, passed(client, pod, NAMES)) == scores(client, pod_json("fresh", 1), NAMES)
        counts = prepared_counts(client)
    assert counts.get("computed") == WINDOW // 4 + 2 and counts.get("prepared", 0.0) == 0.0
