"""MIG answers kept between requests (extender.placement.engine keeps them by node name in PlacementMemo) follow
the node's published MIG state at once, through real HTTP against a cluster-mode extender and the fake apiserver.

The node's placement state (what NodeCache.on_state_change reports) holds whole GPUs only, so a MIG node's state
stays the same object while its instances are taken and given back: these tests check that it does, then that
filter, prioritize and bind answer from the new instances anyway."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from extender.service import Extender
from gputopo.contract import parse_plan
from gputopo.core import NodeState, state_to_json, topology_to_json
from gputopo.core.codec import Mig, MigGpuInfo
from tests.extender.conftest import DGX1, topo
from tests.extender.test_cluster import cluster, filter_names
from tests.extender.test_mig import ONE, k8s_mig_pod, sevens
from tests.fakes.kubeapi import FakeKubeApi
from tests.helpers.kube import GPU, PREFIX, k8s_node, k8s_pod, node_annotations
from tests.helpers.scheduler import bind_body, cache_args, list_args, node_item

PLAN, STATE = f"{PREFIX}/plan", f"{PREFIX}/state"


def island_gpu(node: str, used: int) -> MigGpuInfo:
    """A MIG GPU of a DGX-1 (index 7, NVLink island 0 with GPU0 and GPU1), cut in seven, the first `used` held."""
    g = sevens(node, 7, used)
    return MigGpuInfo(g.gpu, g.index, g.numa, 0, g.model, g.instances, ("GPU0", "GPU1"))


def annotations(name: str, used: int, generation: int, with_topology: bool) -> dict[str, str]:
    """What the plugin publishes: a MIG GPU with `used` of its seven instances held, on a DGX-1 when
    `with_topology` (its whole GPUs all free), else alone."""
    gpu = island_gpu(name, used) if with_topology else sevens(name, 0, used)
    ann = {STATE: state_to_json(NodeState(generation, frozenset(), frozenset(), None, Mig("mixed", None, (gpu,))))}
    if with_topology:
        ann[f"{PREFIX}/topology"] = topology_to_json(topo(DGX1))
    return ann


def node(name: str, used: int, with_topology: bool) -> dict[str, Any]:
    out = k8s_node(name, annotations=annotations(name, used, 1, with_topology))
    out["status"]["allocatable"] = {ONE: "7"}
    return out


def publish(fake: FakeKubeApi, ext: Extender, name: str, used: int, generation: int, with_topology: bool) -> None:
    """The plugin publishes a new MIG state; returns once the extender's cache holds it."""
    fake.update_node(name, {"metadata": {"annotations": annotations(name, used, generation, with_topology)}})
    assert ext.cache.wait_for(lambda: getattr(ext.cache.nodes.get(name), "generation", 0) == generation, 10)


def scores(client: httpx.Client, pod: dict[str, Any], names: list[str]) -> dict[str, int]:
    r = client.post("/prioritize", json=cache_args(pod, names))
    assert r.status_code == 200
    return {s["Host"]: s["Score"] for s in r.json()}


@pytest.mark.parametrize("with_topology", [False, True], ids=["mig-only", "dgx1-with-a-mig-gpu"])
def test_filter_and_bind_follow_the_published_instances_at_once(fake: FakeKubeApi, api, with_topology: bool
                                                                 ) -> None:
    fake.add_node(node("n1", 6, with_topology))  # one instance free: the seventh
    pod = fake.add_pod(k8s_mig_pod("p", 1))
    with cluster(api) as (ext, client):
        assert filter_names(client, pod, ["n1"])["NodeNames"] == ["n1"]
        assert scores(client, pod, ["n1"])["n1"] > 0
        state = ext.cache.states["n1"]
        publish(fake, ext, "n1", 7, 2, with_topology)  # all seven held
        assert ext.cache.states["n1"] is state  # the node's placement state did not change: no forget hook ran
        out = filter_names(client, pod, ["n1"])
        assert out["NodeNames"] == []
        assert out["FailedNodes"] == {"n1": "needs 1 1g.18gb instance, 0 free: 7 in use"}
        assert scores(client, pod, ["n1"]) == {"n1": 0}
        assert "cannot take pod" in client.post("/bind", json=bind_body(pod, "n1")).json()["Error"]
        publish(fake, ext, "n1", 2, 3, with_topology)  # five free again, the seventh among them
        assert ext.cache.states["n1"] is state
        assert filter_names(client, pod, ["n1"])["NodeNames"] == ["n1"]
        assert client.post("/bind", json=bind_body(pod, "n1")).json() == {"Error": ""}
    gpu = 7 if with_topology else 0
    # the lowest free slice of the new state, not the seventh the first answer chose
    assert parse_plan(fake.pod("default", "p")["metadata"]["annotations"][PLAN]).ids == {f"MIG-n1-{gpu}-2"}


def test_prioritize_follows_the_published_instances_at_once(fake: FakeKubeApi, api) -> None:
    fake.add_node(node("a", 3, False))
    fake.add_node(node("b", 0, False))
    pod = fake.add_pod(k8s_mig_pod("p", 1))
    with cluster(api) as (ext, client):
        first = scores(client, pod, ["a", "b"])
        assert first["a"] > first["b"]  # a's GPU is partly used: it fills first, b's GPU stays whole
        publish(fake, ext, "b", 5, 2, False)  # b's GPU is now the fuller one
        then = scores(client, pod, ["a", "b"])
        assert then["b"] > then["a"]
        publish(fake, ext, "b", 0, 3, False)  # and whole again
        assert scores(client, pod, ["a", "b"]) == first


def test_a_requests_own_unseen_mig_node_is_judged_from_that_request(fake: FakeKubeApi, api) -> None:
    pod = fake.add_pod(k8s_mig_pod("p", 1))

    def listed(used: int) -> dict[str, Any]:
        r = client.post("/filter", json=list_args(pod, [node_item("u", annotations("u", used, 1, False))]))
        assert r.status_code == 200
        return r.json()

    with cluster(api) as (_, client):
        free, full = listed(6), listed(7)  # the same name, generation and placement state: other instances
    assert [i["metadata"]["name"] for i in free["Nodes"]["items"]] == ["u"]
    assert full["Nodes"]["items"] == [] and full["FailedNodes"] == {"u": "needs 1 1g.18gb instance, 0 free: 7 in use"}


def test_an_unseen_single_strategy_node_takes_gpu_pods_on_its_instances(fake: FakeKubeApi, api) -> None:
    """The configured resource goes the MIG way when only a request's own unseen node advertises instances as it
    (NVIDIA's single strategy): the route is decided from the request's nodes too, and the whole-GPU nodes beside
    it are still judged whole."""
    single = Mig("single", None, (sevens("s", 0, 7, resource=GPU), sevens("s", 1, 5, resource=GPU)))
    items = [node_item("s", {STATE: state_to_json(NodeState(1, frozenset(), frozenset(), None, single))}),
             node_item("w", node_annotations(topo(DGX1)))]
    with cluster(api) as (ext, client):
        assert GPU not in ext.cache.mig_names  # no node of the cache serves it with instances
        two = client.post("/filter", json=list_args(fake.add_pod(k8s_pod("two", 2)), items)).json()
        three = client.post("/filter", json=list_args(fake.add_pod(k8s_pod("three", 3)), items)).json()
    assert [i["metadata"]["name"] for i in two["Nodes"]["items"]] == ["s", "w"]
    assert [i["metadata"]["name"] for i in three["Nodes"]["items"]] == ["w"]
    assert three["FailedNodes"] == {"s": "needs 3 1g.18gb instances, 2 free: 12 in use"}
