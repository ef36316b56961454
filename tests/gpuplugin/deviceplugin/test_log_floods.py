"""A hostile or broken client must not flood the node's log (issue 20, item 5): refused ListAndWatch streams and
Allocates the host has no device nodes for are logged first, then once per interval with a count, through the real
gRPC server. The clock is injected, so the intervals pass when the test says."""

from __future__ import annotations

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
