"""The request and answer body sizes per verb (gpu_extender_request_body_bytes / _response_body_bytes): what the
scale benchmark reads to say how many bytes a /filter costs on the wire."""

from __future__ import annotations

import json

from bench.real_scheduler import histogram
from tests.extender.conftest import A100, PCIE
from tests.helpers.scheduler import cache_args, pod_json

NODES = [{"name": "a100", "topology": A100}, {"name": "pcie", "topology": PCIE}]


def test_filter_bodies_are_counted_at_their_exact_size(standalone) -> None:
    body = json.dumps(cache_args(pod_json(gpus=1), ["a100", "pcie"])).encode()
    with standalone(NODES) as (_, client):
        answer = client.post("/filter", content=body, headers={"Content-Type": "application/json"})
        text = client.get("/metrics").text
    assert answer.status_code == 200
    assert histogram(text, "gpu_extender_request_body_bytes", verb="filter") == (len(body), 1)
    assert histogram(text, "gpu_extender_response_body_bytes", verb="filter") == (len(answer.content), 1)
    assert histogram(text, "gpu_extender_request_body_bytes", verb="prioritize") == (0, 0)


def test_a_malformed_body_still_counts_its_answer(standalone) -> None:
    with standalone(NODES) as (_, client):
        answer = client.post("/filter", content=b"{not json", headers={"Content-Type": "application/json"})
        text = client.get("/metrics").text
    assert answer.status_code == 400
    assert histogram(text, "gpu_extender_request_body_bytes", verb="filter") == (9, 1)
    assert histogram(text, "gpu_extender_response_body_bytes", verb="filter") == (len(answer.content), 1)
