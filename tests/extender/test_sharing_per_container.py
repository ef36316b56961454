"""failRequestsGreaterThanOne bounds each container's request, not the pod's total (the extender's half).

The kubelet calls the device plugin's Allocate once per container (init containers included), and both NVIDIA's
plugin (rm.ValidateRequest per ContainerAllocateRequest) and ours (gpuplugin.sharing.manager) refuse only a request
for more than one replica. So a pod of two containers asking one replica each is admitted on such a node, and the
extender must not refuse it at filter; a container asking two still is refused. Through the real HTTP server.
"""

from __future__ import annotations

from typing import Any

from tests.extender.conftest import DGX1
from tests.extender.test_sharing import SHARED, plans, sharing_block
from tests.helpers.scheduler import bind_body, cache_args, pod_json

REFUSAL = ("a container asks for {n} replicas of " + SHARED + "; this node's sharing config refuses more than one "
           "per container (failRequestsGreaterThanOne)")


def _asking(c: dict[str, Any], n: int) -> dict[str, Any]:
    c["resources"] = {"limits": {SHARED: str(n)}, "requests": {SHARED: str(n)}} if n else {}
    return c


def split_pod(name: str, apps: list[int], inits: list[tuple[int, bool]] | None = None) -> dict[str, Any]:
    """A pod whose app containers ask `apps` replicas each, after init containers asking (replicas, sidecar)."""
    pod = pod_json(name, containers=[{"name": f"app-{i}"} for i in range(len(apps))],
                   init_containers=[{"name": f"init-{i}", "sidecar": s} for i, (_, s) in enumerate(inits or [])])
    for c, n in zip(pod["spec"]["containers"], apps, strict=True):
        _asking(c, n)
    for c, (n, _) in zip(pod["spec"].get("initContainers", []), inits or [], strict=True):
        _asking(c, n)
    return pod


NODES = [{"name": "one-each", "topology": DGX1, "sharing": sharing_block(4, one_per_pod=True)},
         {"name": "several", "topology": DGX1, "sharing": sharing_block(4)}]
NAMES = [n["name"] for n in NODES]


def test_two_containers_of_one_replica_each_pass_where_the_node_allows_one_per_request(standalone) -> None:
    with standalone(NODES) as (_, client):
        out = client.post("/filter", json=cache_args(split_pod("pair", [1, 1]), NAMES)).json()
        scores = {s["Host"]: s["Score"] for s in
                  client.post("/prioritize", json=cache_args(split_pod("pair", [1, 1]), NAMES)).json()}
    assert out["NodeNames"] == NAMES and not out["FailedNodes"] and not out["FailedAndUnresolvableNodes"]
    assert scores["one-each"] > 0


def test_one_container_asking_two_is_still_refused_with_the_per_container_reason(standalone) -> None:
    with standalone(NODES) as (_, client):
        out = client.post("/filter", json=cache_args(split_pod("two", [2]), NAMES)).json()
    assert out["NodeNames"] == ["several"]
    assert out["FailedAndUnresolvableNodes"] == {"one-each": REFUSAL.format(n=2)}


def test_the_memo_tells_equal_totals_with_different_splits_apart(standalone) -> None:
    """Same node state, same total (2), asked in turn: the answer follows each pod's largest container."""
    with standalone(NODES) as (_, client):
        answers = [client.post("/filter", json=cache_args(split_pod(f"p{i}", apps), NAMES)).json()
                   for i, apps in enumerate([[1, 1], [2], [1, 1], [2]])]
    assert [a["NodeNames"] for a in answers] == [NAMES, ["several"], NAMES, ["several"]]
    assert [a["FailedAndUnresolvableNodes"] for a in answers] == [{}, {"one-each": REFUSAL.format(n=2)}] * 2


def test_init_containers_are_requests_of_their_own(standalone) -> None:
    """A sidecar and an app container of one replica each are two requests of one (size 2, admitted); an init
    container asking two is one request of two (refused, although the pod's size is max(2, 1) = 2 either way)."""
    with standalone(NODES) as (_, client):
        sidecar = client.post("/filter", json=cache_args(split_pod("sc", [1], [(1, True)]), NAMES)).json()
        init = client.post("/filter", json=cache_args(split_pod("in", [1], [(2, False)]), NAMES)).json()
    assert sidecar["NodeNames"] == NAMES
    assert init["NodeNames"] == ["several"]
    assert init["FailedAndUnresolvableNodes"] == {"one-each": REFUSAL.format(n=2)}


def test_bind_commits_what_filter_passed_one_replica_per_container_on_distinct_gpus(standalone) -> None:
    """Bind chooses the replicas again under the node's lock: it must read the pod per container as filter did,
    or filter passes the pod and every bind refuses it."""
    pod = split_pod("pair", [1, 1])
    with standalone(NODES[:1]) as (_, client):
        assert client.post("/filter", json=cache_args(pod, ["one-each"])).json()["NodeNames"] == ["one-each"]
        assert client.post("/bind", json=bind_body(pod, "one-each")).json() == {"Error": ""}
        containers = plans(client)["pair"]["containers"]
    assert len(containers["app-0"]) == len(containers["app-1"]) == 1
    assert containers["app-0"] != containers["app-1"]
