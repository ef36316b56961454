"""Open ListAndWatch streams against the calls pod admission and registration depend on (issue 14, item 1): any
number of streams leaves GetDevicePluginOptions, GetPreferredAllocation and Allocate answered, streams past the
bound are refused with RESOURCE_EXHAUSTED, and a restarted kubelet can still register while streams are held."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from gpuplugin.deviceplugin.resource import ResourceManager
from gpuplugin.proto import deviceplugin_pb2 as pb
from gpuplugin.proto import deviceplugin_pb2_grpc as pb_grpc
from gputopo.core.topology import Topology
from sim.kubelet import KubeletSimulator
from tests.gpuplugin.deviceplugin.conftest import RESOURCE, RunnerFactory, sample
from tests.helpers.polling import eventually

WAIT = 10.0
SOCKET = "gpu-topology.sock"


@contextmanager
def streams(plugin_dir: Path, count: int) -> Iterator[list[grpc.Future]]:
    """`count` ListAndWatch streams held open on the plugin's socket (an attacker's, not the kubelet's)."""
    channel = grpc.insecure_channel(f"unix:{plugin_dir / SOCKET}")
    stub = pb_grpc.DevicePluginStub(channel)
    calls = [stub.ListAndWatch(pb.Empty()) for _ in range(count)]
    try:
        yield calls
    finally:
        for call in calls:
            call.cancel()
        channel.close()


def admission_calls(plugin_dir: Path, ids: list[str]) -> tuple[pb.DevicePluginOptions, list[str], int]:
    """The three calls a kubelet makes, each with a deadline: options, a preference of 2, an allocation of it."""
    with grpc.insecure_channel(f"unix:{plugin_dir / SOCKET}") as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        options = stub.GetDevicePluginOptions(pb.Empty(), timeout=WAIT)
        pref = stub.GetPreferredAllocation(pb.PreferredAllocationRequest(container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=2)]), timeout=WAIT)
        chosen = list(pref.container_responses[0].deviceIDs)
        alloc = stub.Allocate(pb.AllocateRequest(container_requests=[
            pb.ContainerAllocateRequest(devices_ids=chosen)]), timeout=WAIT)
    return options, chosen, len(alloc.container_responses)


def test_open_streams_do_not_starve_admission_calls(
    kubelet: KubeletSimulator, start_plugin: RunnerFactory, dgx1: Topology, plugin_dir: Path
) -> None:
    manager = ResourceManager(dgx1)
    start_plugin(manager)
    ids = [d.id for d in kubelet.wait_for_devices(RESOURCE, 8, WAIT)]
    with streams(plugin_dir, 14) as held:  # with the kubelet's own: 15, more than the threads the plugin has
        options, chosen, answered = admission_calls(plugin_dir, ids)
        assert options.get_preferred_allocation_available
        assert len(chosen) == 2 and answered == 1
        assert all(len(next(call).devices) == 8 for call in held)  # every stream is live, with the full list
        assert sample(manager, "gpuplugin_listandwatch_streams") == 15


def test_streams_past_the_bound_are_refused(
    kubelet: KubeletSimulator, start_plugin: RunnerFactory, dgx1: Topology, plugin_dir: Path
) -> None:
    manager = ResourceManager(dgx1)
    start_plugin(manager, max_streams=4)
    ids = [d.id for d in kubelet.wait_for_devices(RESOURCE, 8, WAIT)]
    with streams(plugin_dir, 3) as held:
        assert all(len(next(call).devices) == 8 for call in held)
        with streams(plugin_dir, 1) as extra:
            with pytest.raises(grpc.RpcError) as err:
                next(extra[0])
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "4 ListAndWatch streams" in (err.value.details() or "")
        assert sample(manager, "gpuplugin_listandwatch_streams_refused_total") == 1
        assert admission_calls(plugin_dir, ids)[2] == 1
        held[0].cancel()
        assert eventually(lambda: sample(manager, "gpuplugin_listandwatch_streams") == 3, WAIT, interval=0.02)
        with streams(plugin_dir, 1) as again:  # a freed place is served again
            assert len(next(again[0]).devices) == 8
    # The kubelet's stream was never disturbed.
    assert kubelet.wait_for_devices(RESOURCE, 8, WAIT)


def test_restarted_kubelet_registers_while_streams_are_held(
    start_plugin: RunnerFactory, dgx1: Topology, plugin_dir: Path
) -> None:
    """A kubelet restart deletes our socket; the plugin serves anew, streams are opened on the new socket before the
    kubelet is back, and the kubelet's dial-back (GetDevicePluginOptions inside Register) must still be answered."""
    kubelet = KubeletSimulator(plugin_dir, dial_timeout=3.0).start()
    try:
        manager = ResourceManager(dgx1)
        runner = start_plugin(manager)
        kubelet.wait_for_registrations(RESOURCE, 1, WAIT)
        kubelet.stop()
        old = runner._server.identity if runner._server else None
        (plugin_dir / SOCKET).unlink()
        assert eventually(lambda: runner.serving and runner._server is not None and runner._server.identity != old,
                          WAIT, interval=0.02)
        with streams(plugin_dir, 15):
            server = runner._server
            # as many as a thread pool used to have
            assert eventually(lambda: server.servicer.stream_count >= 8, WAIT, interval=0.02)
            kubelet.start()
            kubelet.wait_for_registrations(RESOURCE, 2, 2 * WAIT)
            assert kubelet.rejections == []
            assert len(kubelet.wait_for_devices(RESOURCE, 8, WAIT)) == 8
            assert eventually(lambda: sample(manager, "gpuplugin_listandwatch_streams") == 16, WAIT, interval=0.02)
    finally:
        kubelet.stop()
