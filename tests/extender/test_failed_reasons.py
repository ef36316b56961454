"""What a pod that cannot be placed shows: kube-scheduler turns filter's FailedNodes and
FailedAndUnresolvableNodes into "0/N nodes are available: <count> <reason>, ..." (every distinct reason once, with
the number of nodes that gave it, sorted), cut at 1024 bytes in the FailedScheduling event and not cut at all in
the PodScheduled condition (pkg/scheduler: findNodesThatPassExtenders, FitError.Error, truncateMessage). The
reasons stay detailed while they are few and group into node-independent forms when they are many."""

from __future__ import annotations

from collections import Counter
from itertools import combinations
from typing import Any

import httpx
import kubernetes.client

from extender.placement import reasons
from tests.extender.conftest import A100, topo
from tests.extender.test_cluster import cluster
from tests.fakes.kubeapi import FakeKubeApi
from tests.helpers.kube import PREFIX, k8s_node, k8s_pod
from tests.helpers.scheduler import cache_args

PATTERNS = [*combinations(range(8), 3), *combinations(range(8), 4)]
NOTE_LIMIT = 1024  # k8s.io/api/events validation.NoteLengthLimit


def fit_error(total: int, answer: dict[str, Any]) -> str:
    """kube-scheduler's FitError.Error for the extender's answer (no other plugin refusing)."""
    counts = Counter([*answer["FailedNodes"].values(), *answer["FailedAndUnresolvableNodes"].values()])
    return f"0/{total} nodes are available: " + ", ".join(sorted(f"{n} {r}" for r, n in counts.items())) + "."


def event_note(message: str) -> str:
    """handleSchedulingFailure's truncateMessage for the event."""
    return message if len(message) <= NOTE_LIMIT else message[:NOTE_LIMIT - 4] + " ..."


def _filter(client: httpx.Client, pod: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return client.post("/filter", json=cache_args(pod, names)).json()


def test_a_few_nodes_keep_their_detailed_reasons(fake: FakeKubeApi, api: kubernetes.client.ApiClient) -> None:
    t = topo(A100)
    fake.add_node(k8s_node("n1", t, used=[0, 1]))
    fake.add_node(k8s_node("n2", t, used=[2, 3, 4], unhealthy=[7]))
    pod = fake.add_pod(k8s_pod("p", 7))
    with cluster(api) as (_, client):
        answer = _filter(client, pod, ["n1", "n2"])
    assert fit_error(2, answer) == ("0/2 nodes are available: 1 needs 7 GPUs, 4 free: GPU 2-4 in use, GPU 7 "
                                    "unhealthy, 1 needs 7 GPUs, 6 free: GPU 0,1 in use.")


def test_many_nodes_group_into_a_short_readable_event(fake: FakeKubeApi, api: kubernetes.client.ApiClient) -> None:
    """120 busy nodes, each with its own used GPUs, and 8 without a usable topology: without grouping the event
    would list 128 reasons and be cut off mid-list, and the pod's condition would carry all of them."""
    t = topo(A100)
    names = []
    for i in range(120):
        used = list(PATTERNS[i * 7 % len(PATTERNS)])  # 3 or 4 of 8 GPUs in use, each node its own
        fake.add_node(k8s_node(f"busy-{i:03d}", t, used=used))
        names.append(f"busy-{i:03d}")
    for i in range(8):
        fake.add_node(k8s_node(f"broken-{i}", t, annotations={f"{PREFIX}/topology": f'{{"v": 1, "gpus": {i}}}'}))
        names.append(f"broken-{i}")
    pod = fake.add_pod(k8s_pod("p", 6))
    with cluster(api) as (_, client):
        answer = _filter(client, pod, names)
    assert set(answer["FailedNodes"]) | set(answer["FailedAndUnresolvableNodes"]) == set(names)
    message = fit_error(len(names), answer)
    assert event_note(message) == message, "the event is not cut"
    distinct = set(answer["FailedNodes"].values()) | set(answer["FailedAndUnresolvableNodes"].values())
    assert sum(map(len, distinct)) <= reasons.MAX_REASONS_CHARS
    assert " in use" not in message, "no node's own GPU list"
    assert "8 GPU topology annotation gpu-topology.io/topology is unreadable" in message
    assert {r for r in distinct if r.startswith("needs 6 GPUs")} == {"needs 6 GPUs, 4 free", "needs 6 GPUs, 5 free"}


def test_coarsened_picks_the_finest_grain_that_fits() -> None:
    detailed = [reasons.Failed(reasons.shortfall((i + 3) << 1, 0, 0, 0b1, 4)) for i in range(40)]
    few = [True, *detailed[:2], True]
    assert reasons.coarsened(few) == few
    assert set(reasons.coarsened([True, *detailed])) == {True, "needs 4 GPUs, 1 free"}
    problems = [reasons.Unresolvable(reasons.node_problem(f"annotation {i}: " + "x" * 150)) for i in range(10)]
    words = reasons.coarsened([*detailed, True, *problems])
    assert words[40] is True
    assert set(words[:40]) == {"needs 4 GPUs, fewer free"}
    assert set(words[41:]) == {"publishes no usable GPU topology or state"}


def test_a_hostile_reason_is_one_capped_line() -> None:
    reason = reasons.node_problem("bad\nannotation " + "\u00e9" * 10_000)
    assert len(reason) <= reasons.MAX_REASON_CHARS and "\n" not in reason
    assert reason.startswith("bad annotation \u00e9") and "..." in reason and reason.endswith("\u00e9")  # elided inside
