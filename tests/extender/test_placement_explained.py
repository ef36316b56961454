"""Every bound pod carries `<prefix>/placement` next to its plan: the chosen node and GPUs, their GB/s and
efficiency vs the empty node, and how that compares with the fastest set the pod's candidate nodes offered, saying
why a faster node was passed over. Through the real verbs over HTTP, with the Binding posted to FakeKubeApi."""

from __future__ import annotations

from typing import Any

import httpx
import kubernetes.client

from extender.placement.explain import MAX_CHARS, Explainer
from extender.state.pods import Need
from tests.extender.conftest import A100, PCIE, topo
from tests.extender.test_cluster import cluster
from tests.fakes.kubeapi import FakeKubeApi
from tests.helpers.kube import PREFIX, k8s_node, k8s_pod
from tests.helpers.paths import SHARED
from tests.helpers.scheduler import bind_body, cache_args

A6000 = SHARED / "topologies" / "pcie-8x-rtxa6000-nvlinkbridge-pairs-2socket-unige-baobab.txt"
PLACEMENT = f"{PREFIX}/placement"


def _place(fake: FakeKubeApi, client: httpx.Client, pod: dict[str, Any], candidates: list[str], node: str,
           prioritize: bool = True) -> str:
    """filter (and prioritize) over `candidates`, then bind to `node`, as kube-scheduler would; the annotation."""
    assert node in client.post("/filter", json=cache_args(pod, candidates)).json()["NodeNames"]
    if prioritize:
        assert client.post("/prioritize", json=cache_args(pod, candidates)).status_code == 200
    assert client.post("/bind", json=bind_body(pod, node)).json() == {"Error": ""}
    stored = fake.pod(pod["metadata"]["namespace"], pod["metadata"]["name"])
    assert stored is not None
    text = stored["metadata"]["annotations"][PLACEMENT]
    assert len(text) <= MAX_CHARS and "\n" not in text
    return text


def _scores(client: httpx.Client, pod: dict[str, Any], names: list[str]) -> dict[str, int]:
    return {h["Host"]: h["Score"] for h in client.post("/prioritize", json=cache_args(pod, names)).json()}


def test_the_fastest_node_is_said_to_be_the_fastest(fake: FakeKubeApi, api: kubernetes.client.ApiClient) -> None:
    fake.add_node(k8s_node("a100", topo(A100)))
    fake.add_node(k8s_node("pcie", topo(PCIE)))
    fake.add_node(k8s_node("a100-b", topo(A100)))
    fake.add_node(k8s_node("a100-c", topo(A100)))
    fake.add_node(k8s_node("a100-d", topo(A100)))
    fake.add_node(k8s_node("a100-e", topo(A100)))
    pod = fake.add_pod(k8s_pod("p", 4))
    with cluster(api) as (_, client):
        text = _place(fake, client, pod, ["a100", "pcie", "a100-b", "a100-c", "a100-d", "a100-e"], "a100")
    assert text.startswith("a100 GPUs ") and ": 240.0 GB/s, efficiency vs the empty node 1.00" in text
    assert "the fastest of 6 candidate nodes" in text


def test_an_island_kept_for_larger_pods_is_named(fake: FakeKubeApi, api: kubernetes.client.ApiClient) -> None:
    """The only whole NVSwitch node is kept for an 8-GPU pod: a 2-GPU pod gets an NVLink bridge pair instead."""
    fake.add_node(k8s_node("a100", topo(A100)))
    fake.add_node(k8s_node("a6000", topo(A6000)))
    pod = fake.add_pod(k8s_pod("p", 2))
    with cluster(api) as (_, client):
        scores = _scores(client, pod, ["a100", "a6000"])
        assert scores["a6000"] > scores["a100"]
        text = _place(fake, client, pod, ["a100", "a6000"], "a6000")
    assert text.startswith("a6000 GPUs ")
    assert "fastest offered 240.0 GB/s on a100, passed over to keep its free 8-GPU island (240 GB/s)" in text
    assert "4-GPU island" not in text, "a 4-GPU island it leaves whole is not why"


def test_a_node_kube_scheduler_chose_over_our_first_is_said_so(fake: FakeKubeApi,
                                                               api: kubernetes.client.ApiClient) -> None:
    for name in ("a100", "a100-b", "a100-c", "a100-d", "a100-e"):
        fake.add_node(k8s_node(name, topo(A100)))
    fake.add_node(k8s_node("pcie", topo(PCIE)))
    pod = fake.add_pod(k8s_pod("p", 2, annotations={f"{PREFIX}/min-allreduce-gbps": "10"}))
    with cluster(api) as (_, client):
        text = _place(fake, client, pod, ["a100", "a100-b", "a100-c", "a100-d", "a100-e", "pcie"], "pcie")
    assert text.startswith("pcie GPUs ")
    assert "fastest offered 240.0 GB/s on a100" in text and "kube-scheduler's other scores" in text
    assert text.endswith("constraints: min-allreduce 10 GB/s")


def test_without_a_ranking_and_for_one_gpu(fake: FakeKubeApi, api: kubernetes.client.ApiClient) -> None:
    fake.add_node(k8s_node("a100", topo(A100), used=[0, 1]))
    two = fake.add_pod(k8s_pod("two", 2, annotations={f"{PREFIX}/require-nvlink": "true"}))
    one = fake.add_pod(k8s_pod("one", 1))
    with cluster(api) as (_, client):
        text = _place(fake, client, two, ["a100"], "a100", prioritize=False)
        single = _place(fake, client, one, ["a100"], "a100")
    assert "not ranked by this extender" in text and text.endswith("constraints: require-nvlink")
    assert single.startswith("a100 GPU ") and "one GPU, no all-reduce" in single


def test_the_offers_kept_are_bounded_and_the_text_capped() -> None:
    explainer = Explainer(lambda _t, _s: 100.0, limit=3)
    for i in range(10):
        explainer.remember(f"uid-{i}", None)
    assert len(explainer._offers) == 3
    t = topo(A100)
    text = explainer.explain("uid-9", "n" * 300, t, [0, 1], 50.0, Need(2, True, 100.0), notes=["x" * 300])
    # elided in the middle, never cut at the end: the node's name and the long note keep their heads and tails
    assert len(text) <= MAX_CHARS and text.endswith("x") and not text.endswith("...")
    assert text.startswith("n" * 30 + "..." + "n" * 30 + " GPUs 0,1: 50.0 GB/s")
    assert "; constraints: require-nvlink, min-allreduce 100 GB/s; xxx" in text and "x..." in text
