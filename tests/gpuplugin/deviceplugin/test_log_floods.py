"""A hostile or broken client must not flood the node's log (issue 20, item 5): refused ListAndWatch streams and
Allocates the host has no device nodes for are logged first, then once per interval with a count, through the real
gRPC server. The clock is injected, so the intervals pass when the test says."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
import structlog

from gpuplugin.deviceplugin.resource import ResourceManager
from gpuplugin.proto import deviceplugin_pb2 as pb
from gpuplugin.proto import deviceplugin_pb2_grpc as pb_grpc
from gputopo.core.topology import Topology
from gputopo.logs import Repeats
from sim.kubelet import KubeletSimulator
from tests.gpuplugin.deviceplugin.conftest import RESOURCE, RunnerFactory, sample
from tests.helpers.polling import eventually

WAIT = 10.0
INTERVAL = 10.0


class Clock:
    """Time that moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def refused_streams(plugin_dir: Path, count: int) -> None:
    """`count` ListAndWatch calls, each refused (the kubelet's stream fills the bound of one)."""
    with grpc.insecure_channel(f"unix:{plugin_dir / 'gpu-topology.sock'}") as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        for _ in range(count):
            with pytest.raises(grpc.RpcError) as err:
                next(stub.ListAndWatch(pb.Empty(), timeout=WAIT))
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED


def allocations(kubelet: KubeletSimulator, count: int) -> None:
    for _ in range(count):
        assert list(kubelet.allocate(RESOURCE, ["GPU0", "GPU1"]).devices) == []  # no nodes on this host


def events(logs: list[dict[str, object]], name: str) -> list[dict[str, object]]:
    return [e for e in logs if e["event"] == name]


def test_refused_streams_and_allocations_without_device_nodes_log_first_then_a_count_per_interval(
    kubelet: KubeletSimulator, start_plugin: RunnerFactory, dgx1: Topology, plugin_dir: Path, tmp_path: Path
) -> None:
    clock = Clock()
    manager = ResourceManager(dgx1, dev_root=tmp_path, log_interval_s=INTERVAL, clock=clock)
    start_plugin(manager, max_streams=1)
    kubelet.wait_for_devices(RESOURCE, 8, WAIT)
    with structlog.testing.capture_logs() as logs:
        refused_streams(plugin_dir, 150)
        allocations(kubelet, 150)
        clock.now += INTERVAL / 2  # within the interval: counted, not logged
        refused_streams(plugin_dir, 50)
        allocations(kubelet, 50)
        clock.now += INTERVAL
        refused_streams(plugin_dir, 30)
        allocations(kubelet, 30)
    refused = events(logs, "plugin.listandwatch.refused")
    missing = events(logs, "plugin.allocate.device_nodes_missing")
    assert [e["not_logged_since_last"] for e in refused] == [0, 199]
    assert [e["not_logged_since_last"] for e in missing] == [0, 199]
    assert missing[0]["missing"] == ["nvidia0", "nvidia1"]
    # Nothing is lost from the counters, and the kubelet's stream was never disturbed.
    assert sample(manager, "gpuplugin_listandwatch_streams_refused_total") == 230
    assert sample(manager, "gpuplugin_allocations_total", result="ok") == 230
    assert kubelet.wait_for_devices(RESOURCE, 8, WAIT)


def test_repeats_first_at_once_then_one_per_interval_with_the_count() -> None:
    clock = Clock()
    repeats = Repeats(5.0, clock)
    assert repeats.admit() == 0
    assert [repeats.admit() for _ in range(3)] == [None] * 3
    clock.now += 4.999
    assert repeats.admit() is None
    clock.now += 0.001
    assert repeats.admit() == 4
    clock.now += 100
    assert repeats.admit() == 0
    with pytest.raises(ValueError, match="positive"):
        Repeats(0, clock)


def churned_streams(plugin_dir: Path, count: int) -> None:
    """`count` ListAndWatch streams, each opened, read once and cancelled (a client reconnecting in a loop)."""
    with grpc.insecure_channel(f"unix:{plugin_dir / 'gpu-topology.sock'}") as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        for _ in range(count):
            call = stub.ListAndWatch(pb.Empty(), timeout=WAIT)
            assert len(next(call).devices) == 8
            call.cancel()


def info_bytes(logs: list[dict[str, object]]) -> int:
    """What the log would hold at --log-level info, one JSON line per event."""
    return sum(len(json.dumps(e, default=str)) + 1 for e in logs if e["log_level"] != "debug")


def test_allocations_and_churning_streams_add_no_info_line_per_request(
    kubelet: KubeletSimulator, start_plugin: RunnerFactory, dgx1: Topology, plugin_dir: Path, tmp_path: Path
) -> None:
    """A platform team saw 11 MB in 93 s under a churning client, 10.6 MB of it one info line per Allocate: per
    request lines are debug, so the info log is bounded by what happens to the node, not by its clients."""
    manager = ResourceManager(dgx1, dev_root=tmp_path, log_interval_s=INTERVAL, clock=Clock())
    start_plugin(manager)
    kubelet.wait_for_devices(RESOURCE, 8, WAIT)
    with structlog.testing.capture_logs() as logs:
        allocations(kubelet, 300)
        churned_streams(plugin_dir, 100)
        assert eventually(lambda: sample(manager, "gpuplugin_listandwatch_streams") == 1, WAIT)  # all closed
    assert sample(manager, "gpuplugin_allocations_total", result="ok") == 300
    # one rate-limited warning (this host has no device nodes) is all: under 3 bytes per request
    assert info_bytes(logs) < 1200, [e for e in logs if e["log_level"] != "debug"]
    assert len(events(logs, "plugin.allocate.done")) == 300  # still there at debug
    assert len(events(logs, "plugin.listandwatch.opened")) == len(events(logs, "plugin.listandwatch.closed")) == 100
