"""The GPU Feature Discovery labels of the shared layout under `auto` (written only while GFD does not label the
Node, never taking a key from it) and a refused sharing config made visible on the Node: a condition decided on the
Node's status each step and one Warning Event per distinct refusal. Against the fake apiserver, with core/v1 Events
served by the subclass below."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import kubernetes.client
import orjson
import pytest

from gpuplugin.config import PluginConfig
from gpuplugin.deviceplugin.resource import ResourceManager
from gpuplugin.publisher import GFD_TIMESTAMP, NodePublisher, start_publisher
from gpuplugin.sharing.labels import MPS_CAPABLE, PRODUCT, REPLICAS, STRATEGY
from gpuplugin.sharing.node import ConfigSource, SharingNode
from gputopo.contract import Keys
from gputopo.core.topology import Topology
from gputopo.discovery.loader import load_topology_file
from gputopo.kube.client import make_api_client
from tests.fakes.kubeapi import FakeKubeApi
from tests.fakes.kubeapi.status import ApiError, status_failure
from tests.fakes.kubelet_podresources import PodResourcesServer
from tests.fixtures.nvml import HGX
from tests.gpuplugin.publisher.conftest import NODE, node_object
from tests.helpers.polling import eventually

PREFIX = "gpu-topology.io"
CONDITION = "GPUSharingConfigValid"
OURS = {REPLICAS: "4", STRATEGY: "time-slicing", PRODUCT: "NVIDIA-A100-SXM4-80GB-SHARED", MPS_CAPABLE: "false"}
GFDS = {GFD_TIMESTAMP: "1765000000", REPLICAS: "2", STRATEGY: "mps", PRODUCT: "NVIDIA-A100-SXM4-80GB",
        MPS_CAPABLE: "true"}


class EventsKubeApi(FakeKubeApi):
    """FakeKubeApi plus POST /api/v1/namespaces/<ns>/events (what the plugin does with Events: create them)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.events: list[dict[str, Any]] = []
        self.refuse_events = False
        self._names = itertools.count()

    def _route(self, h: Any, method: str, path: str, query: dict[str, str], body: bytes) -> None:
        parts = path.strip("/").split("/")
        if parts[:3] == ["api", "v1", "namespaces"] and parts[4:] == ["events"] and method == "POST":
            if self.refuse_events:
                raise ApiError(status_failure(403, "Forbidden", "events is forbidden"))
            event = orjson.loads(body)
            meta = event["metadata"]
            meta["name"] = meta.pop("generateName", "") + str(next(self._names))
            meta["namespace"] = parts[3]
            with self._cond:
                self.events.append(event)
            h.send_json(201, event)
            return
        super()._route(h, method, path, query, body)


@pytest.fixture
def fake() -> Iterator[EventsKubeApi]:
    with EventsKubeApi() as server:
        yield server


@pytest.fixture
def api(fake: EventsKubeApi) -> Iterator[kubernetes.client.ApiClient]:
    client = make_api_client(host=fake.url, timeout_s=5.0)
    yield client
    client.close()


@pytest.fixture(scope="module")
def topo() -> Topology:
    return load_topology_file(HGX)


def publisher(api: Any, topo: Topology, **options: Any) -> NodePublisher:
    # resync_s=0: every step reads the Node, as a step after the resync interval does
    return NodePublisher(api, NODE, Keys(PREFIX), topo, None, lambda: [], lambda: [], resync_s=0.0, **options)


def labels(fake: FakeKubeApi) -> dict[str, str]:
    return (fake.node(NODE) or {})["metadata"].get("labels", {})


def condition(fake: FakeKubeApi) -> dict[str, Any] | None:
    found = [c for c in (fake.node(NODE) or {}).get("status", {}).get("conditions", []) if c["type"] == CONDITION]
    return found[0] if found else None


def status_patches(fake: FakeKubeApi) -> int:
    return sum(1 for r in fake.requests if r.method == "PATCH" and r.path == f"/api/v1/nodes/{NODE}/status")


# --- GFD labels under auto ---------------------------------------------------------------------------------------


def test_the_default_is_auto_and_the_old_flags_still_turn_it_on_or_off() -> None:
    assert PluginConfig().sharing_labels == "auto"
    assert PluginConfig(sharing_labels="Auto").sharing_labels == "auto"
    assert PluginConfig(sharing_labels="true").sharing_labels is True
    assert PluginConfig(sharing_labels=False).sharing_labels is False


def test_auto_writes_the_labels_where_gfd_does_not_run(fake: FakeKubeApi, api: Any, topo: Topology) -> None:
    fake.add_node(node_object())
    publisher(api, topo, extra_labels=lambda: OURS, gfd_labels="auto").publish_once()
    assert {k: labels(fake).get(k) for k in OURS} == OURS


def test_auto_leaves_a_node_gfd_labels_alone(fake: FakeKubeApi, api: Any, topo: Topology) -> None:
    fake.add_node({**node_object(), "metadata": {**node_object()["metadata"],
                                                  "labels": {**node_object()["metadata"]["labels"], **GFDS}}})
    pub = publisher(api, topo, extra_labels=lambda: OURS, gfd_labels="auto")
    pub.publish_once()
    pub.publish_once()
    assert {k: labels(fake).get(k) for k in GFDS} == GFDS


def test_when_gfd_appears_auto_stops_writing_and_removes_nothing(fake: FakeKubeApi, api: Any,
                                                                  topo: Topology) -> None:
    fake.add_node(node_object())
    pub = publisher(api, topo, extra_labels=lambda: OURS, gfd_labels="auto")
    pub.publish_once()
    # GFD starts on the node: it stamps the node and writes its own values, dropping one of the keys
    gfd = {**GFDS, MPS_CAPABLE: None}
    fake.update_node(NODE, {"metadata": {"labels": gfd}})
    pub.publish_once()
    pub.publish_once()
    now = labels(fake)
    assert {k: now.get(k) for k in gfd} == gfd


def test_auto_removes_only_a_key_it_wrote(fake: FakeKubeApi, api: Any, topo: Topology) -> None:
    """A product label of someone else's stays where the plugin has none to write (mixed models); on, as before,
    the plugin takes the key."""
    fake.add_node(node_object())
    fake.update_node(NODE, {"metadata": {"labels": {PRODUCT: "from-someone-else"}}})
    mine = {**OURS, PRODUCT: None}
    publisher(api, topo, extra_labels=lambda: mine, gfd_labels="auto").publish_once()
    assert labels(fake)[PRODUCT] == "from-someone-else" and labels(fake)[REPLICAS] == "4"

    wanted = dict(OURS)
    pub = publisher(api, topo, extra_labels=lambda: wanted, gfd_labels="auto")
    pub.publish_once()
    wanted[PRODUCT] = None  # what this run wrote it may take back
    pub.publish_once()
    assert PRODUCT not in labels(fake)

    fake.update_node(NODE, {"metadata": {"labels": {PRODUCT: "from-someone-else"}}})
    publisher(api, topo, extra_labels=lambda: mine, gfd_labels=True).publish_once()
    assert PRODUCT not in labels(fake)


def test_on_writes_the_labels_even_where_gfd_runs(fake: FakeKubeApi, api: Any, topo: Topology) -> None:
    fake.add_node(node_object())
    fake.update_node(NODE, {"metadata": {"labels": GFDS}})
    publisher(api, topo, extra_labels=lambda: OURS, gfd_labels=True).publish_once()
    assert {k: labels(fake).get(k) for k in OURS} == OURS


# --- a refused sharing config on the Node ------------------------------------------------------------------------


class Refusal:
    def __init__(self) -> None:
        self.why: str | None = None

    def __call__(self) -> str | None:
        return self.why


def test_a_refusal_sets_the_condition_and_posts_one_event_per_distinct_refusal(
    fake: EventsKubeApi, api: Any, topo: Topology
) -> None:
    fake.add_node(node_object())
    refusal = Refusal()
    pub = publisher(api, topo, config_refusal=refusal)
    pub.publish_once()
    c = condition(fake)
    assert c is not None and (c["status"], c["reason"]) == ("True", "SharingConfigAccepted")
    assert fake.events == []

    refusal.why = "config 'ts': sharing.timeSlicing.resources[0].replicas: must be at least 2"
    for _ in range(3):
        pub.publish_once()
    c = condition(fake)
    assert c is not None and (c["status"], c["reason"], c["message"]) == ("False", "SharingConfigRefused",
                                                                          refusal.why)
    (event,) = fake.events
    assert (event["reason"], event["type"], event["message"]) == ("SharingConfigRefused", "Warning", refusal.why)
    assert (event["involvedObject"]["kind"], event["involvedObject"]["name"]) == ("Node", NODE)
    assert event["involvedObject"]["uid"] == (fake.node(NODE) or {})["metadata"]["uid"]
    patched = status_patches(fake)

    refusal.why = "no config named 'gpu-shared' (have: default, ts)"
    pub.publish_once()
    pub.publish_once()
    assert [e["message"] for e in fake.events][1:] == [refusal.why]
    assert status_patches(fake) == patched + 1

    refusal.why = None
    pub.publish_once()
    c = condition(fake)
    assert c is not None and c["status"] == "True" and len(fake.events) == 2


def test_a_restarted_plugin_does_not_post_the_same_refusal_again(fake: EventsKubeApi, api: Any,
                                                                  topo: Topology) -> None:
    fake.add_node(node_object())
    refusal = Refusal()
    refusal.why = "config 'ts' is not valid YAML"
    publisher(api, topo, config_refusal=refusal).publish_once()
    publisher(api, topo, config_refusal=refusal).publish_once()
    assert len(fake.events) == 1


def test_no_sharing_no_condition(fake: EventsKubeApi, api: Any, topo: Topology) -> None:
    fake.add_node(node_object())
    publisher(api, topo).publish_once()
    assert condition(fake) is None and fake.events == [] and status_patches(fake) == 0


def test_events_forbidden_publication_goes_on_and_the_event_is_posted_once_allowed(
    fake: EventsKubeApi, api: Any, topo: Topology
) -> None:
    fake.add_node(node_object())
    fake.refuse_events = True
    refusal = Refusal()
    refusal.why = "config 'ts' is not valid YAML"
    pub = publisher(api, topo, config_refusal=refusal)
    assert pub.publish_once() is True
    assert f"{PREFIX}/state" in (fake.node(NODE) or {})["metadata"]["annotations"]
    fake.refuse_events = False
    pub.publish_once()
    assert len(fake.events) == 1 and (condition(fake) or {}).get("status") == "False"


def test_a_sharing_node_refusing_its_config_shows_on_the_node(
    fake: EventsKubeApi, api: Any, topo: Topology, tmp_path: Path, kubelet: PodResourcesServer
) -> None:
    """The wiring of `gpuplugin run`: start_publisher given the SharingNode as its manager and sharing on. The
    node's refusal wakes the publisher (its poll here is an hour)."""
    (tmp_path / "default").write_text("version: v1\n")
    label = Refusal()  # the node label's value, as the API would answer it
    node = SharingNode(ResourceManager(topo), "nvidia.com/gpu", "gpu-topology.sock", lambda *a: None,
                       ConfigSource(tmp_path, None, label), poll_interval_s=3600)
    fake.add_node(node_object())
    cfg = SimpleNamespace(node_name=NODE, keys=Keys(PREFIX), resource_name="nvidia.com/gpu",
                          pod_resources_socket=kubelet.socket_path, sharing_labels="auto")
    publication = start_publisher(cfg, node, api=api, poll_interval_s=3600.0, min_interval_s=0.0,
                                  sharing=lambda: None, extra_labels=node.labels)
    assert publication is not None
    try:
        assert eventually(lambda: (condition(fake) or {}).get("status") == "True")
        assert labels(fake)[REPLICAS] == "1"  # auto, no GFD on the node: the labels are written
        label.why = "no-such-config"
        assert node.desired() is None and node.refused is not None and "no-such-config" in node.refused
        assert eventually(lambda: (condition(fake) or {}).get("status") == "False")
        assert "no-such-config" in (condition(fake) or {})["message"]
        assert [e["reason"] for e in fake.events] == ["SharingConfigRefused"]
        label.why = None
        assert node.desired() is not None and node.refused is None
        assert eventually(lambda: (condition(fake) or {}).get("status") == "True")
        assert len(fake.events) == 1
    finally:
        publication.stop()
