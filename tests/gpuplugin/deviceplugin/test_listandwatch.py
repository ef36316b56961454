"""ListAndWatch as the kubelet sees it: the complete list at once, NUMA nodes, and a new complete list on every
health change."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from gpuplugin.deviceplugin.errors import UnknownDeviceError
from gpuplugin.deviceplugin.resource import ResourceManager
from gpuplugin.proto import deviceplugin_pb2 as pb
from gpuplugin.proto import deviceplugin_pb2_grpc as pb_grpc
from gputopo.core.topology import Topology
from sim.kubelet import KubeletSimulator
from tests.gpuplugin.deviceplugin.conftest import RESOURCE, RunnerFactory, sample

WAIT = 10.0


def test_full_list_with_numa(kubelet: KubeletSimulator, start_plugin: RunnerFactory, dgx_a100: Topology) -> None:
    start_plugin(ResourceManager(dgx_a100))
    devices = kubelet.wait_for_devices(RESOURCE, 8, WAIT)
    assert [d.id for d in devices] == list(dgx_a100.ids)
    assert all(d.health == "Healthy" for d in devices)
    assert [d.numa_nodes for d in devices] == [(g.numa_node,) for g in dgx_a100.gpus]
    assert {d.numa_nodes for d in devices} == {(1,), (3,), (5,), (7,)}


def test_unknown_numa_sends_no_topology(kubelet: KubeletSimulator, start_plugin: RunnerFactory, h200: Topology) -> None:
    assert all(g.numa_node is None for g in h200.gpus)  # the VM's NVML does not support NUMA ids
    start_plugin(ResourceManager(h200))
    assert all(d.numa_nodes == () for d in kubelet.wait_for_devices(RESOURCE, 2, WAIT))


def test_uuid_and_index_strategies(plugin_dir: Path, start_plugin: RunnerFactory, h200: Topology) -> None:
    start_plugin(ResourceManager(h200, id_strategy="index"), resource_name="example.com/gpu-index")
    start_plugin(ResourceManager(h200), resource_name="example.com/gpu-uuid", socket_name="uuid.sock")
    with KubeletSimulator(plugin_dir) as sim:
        assert [d.id for d in sim.wait_for_devices("example.com/gpu-index", 2, WAIT)] == ["0", "1"]
        uuids = [d.id for d in sim.wait_for_devices("example.com/gpu-uuid", 2, WAIT)]
    assert uuids == list(h200.ids) and all(u.startswith("GPU-") for u in uuids)


def test_health_change_sends_new_complete_list(
    kubelet: KubeletSimulator, start_plugin: RunnerFactory, dgx_a100: Topology
) -> None:
    manager = ResourceManager(dgx_a100)
    start_plugin(manager)
    kubelet.wait_for_devices(RESOURCE, 8, WAIT)
    updates = kubelet.updates(RESOURCE)
    sick = [dgx_a100.ids[2], dgx_a100.ids[5]]
    assert manager.set_health(sick, healthy=False) == sick
    devices = kubelet.wait_for_devices(RESOURCE, 6, WAIT)
    assert len(devices) == 8  # complete: the unhealthy devices are still listed
    assert {d.id for d in devices if not d.healthy} == set(sick)
    assert kubelet.updates(RESOURCE) == updates + 1
    assert sample(manager, "gpuplugin_health_transitions_total", to="unhealthy") == 2
    # No change, no message.
    assert manager.set_health(sick[:1], healthy=False) == []
    # Recovery, addressed by UUID-or-id alike.
    assert manager.set_health([sick[0]], healthy=True) == [sick[0]]
    devices = kubelet.wait_for_devices(RESOURCE, 7, WAIT)
    assert [d.id for d in devices if not d.healthy] == [sick[1]]
    assert sample(manager, "gpuplugin_health_transitions_total", to="healthy") == 1


def test_health_by_uuid_with_index_ids(kubelet: KubeletSimulator, start_plugin: RunnerFactory, h200: Topology) -> None:
    manager = ResourceManager(h200, id_strategy="index")
    start_plugin(manager)
    kubelet.wait_for_devices(RESOURCE, 2, WAIT)
    assert manager.set_health([h200.ids[1]], healthy=False) == ["1"]
    devices = kubelet.wait_for_devices(RESOURCE, 1, WAIT)
    assert [d.id for d in devices if not d.healthy] == ["1"]


def test_unknown_ids_in_health_update_change_nothing(dgx1: Topology) -> None:
    manager = ResourceManager(dgx1)
    with pytest.raises(UnknownDeviceError, match="GPU99"):
        manager.set_health(["GPU1", "GPU99"], healthy=False)
    assert manager.unhealthy_ids() == []


def test_every_stream_gets_updates(start_plugin: RunnerFactory, dgx1: Topology, plugin_dir: Path) -> None:
    """Two raw streams on the plugin socket (a restarting kubelet can briefly hold two) both see the change."""
    manager = ResourceManager(dgx1)
    start_plugin(manager)
    with grpc.insecure_channel(f"unix:{plugin_dir / 'gpu-topology.sock'}") as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        streams = [stub.ListAndWatch(pb.Empty()), stub.ListAndWatch(pb.Empty())]
        try:
            firsts = [next(s) for s in streams]
            assert all(len(f.devices) == 8 for f in firsts)
            manager.set_health(["GPU0"], healthy=False)
            seconds = [next(s) for s in streams]
            for msg in seconds:
                assert len(msg.devices) == 8
                assert [d.ID for d in msg.devices if d.health == "Unhealthy"] == ["GPU0"]
        finally:
            for s in streams:
                s.cancel()
