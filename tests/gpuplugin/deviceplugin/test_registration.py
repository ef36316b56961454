"""Registration and the kubelet's restarts, against the kubelet simulator over real unix sockets."""

from __future__ import annotations

import os
from pathlib import Path

import grpc
import pytest

from gpuplugin.deviceplugin.errors import RegistrationError
from gpuplugin.deviceplugin.registration import Registrar
from gpuplugin.deviceplugin.resource import ResourceManager
from gpuplugin.proto import deviceplugin_pb2 as pb
from gpuplugin.proto import deviceplugin_pb2_grpc as pb_grpc
from gputopo.core.topology import Topology
from sim.kubelet import KubeletSimulator
from tests.gpuplugin.deviceplugin.conftest import RESOURCE, RunnerFactory, sample
from tests.helpers.paths import short_dir
from tests.helpers.polling import eventually

WAIT = 10.0


def test_registers_with_dial_back_and_options(
    kubelet: KubeletSimulator, start_plugin: RunnerFactory, dgx1: Topology, plugin_dir: Path
) -> None:
    runner = start_plugin(ResourceManager(dgx1))
    kubelet.wait_for_registrations(RESOURCE, 1, WAIT)
    # The simulator dialled our socket and called GetDevicePluginOptions inside Register: it could only succeed
    # because the plugin was already serving.
    assert kubelet.rejections == []
    options = kubelet.options(RESOURCE)
    assert options.get_preferred_allocation_available is True
    assert options.pre_start_required is False
    assert runner.wait_registered(WAIT)
    assert runner.ready()
    assert (plugin_dir / "gpu-topology.sock").exists()


def test_register_request_matches_options_and_endpoint(plugin_dir: Path) -> None:
    req = Registrar(plugin_dir, "gpu-topology.sock", RESOURCE).request()
    assert req.version == "v1beta1"
    assert req.endpoint == "gpu-topology.sock"  # bare name, relative to the plugin directory
    assert req.resource_name == RESOURCE
    assert req.options.get_preferred_allocation_available and not req.options.pre_start_required


def test_registration_fails_when_plugin_does_not_serve(plugin_dir: Path) -> None:
    """The dial-back is real: registering an endpoint nobody serves fails, with the kubelet's message."""
    with KubeletSimulator(plugin_dir, dial_timeout=0.3) as sim:
        with pytest.raises(RegistrationError) as err:
            Registrar(plugin_dir, "nobody.sock", RESOURCE, timeout=5).register()
        assert "failed to dial" in str(err.value)
        assert sim.registrations(RESOURCE) == 0
        assert len(sim.rejections) == 1


def test_kubelet_refusal_is_retried_and_counted(
    kubelet: KubeletSimulator, start_plugin: RunnerFactory, dgx1: Topology
) -> None:
    manager = ResourceManager(dgx1)
    runner = start_plugin(manager, resource_name="gpu")  # not an extended resource name: the kubelet refuses
    assert runner.wait_until(lambda r: r.registration_failures >= 2, WAIT)
    assert not runner.registered
    assert runner.serving
    assert sample(manager, "gpuplugin_registration_failures_total") >= 2
    assert "invalid resource name" in kubelet.rejections[0]


def test_kubelet_restart_reregisters(kubelet: KubeletSimulator, start_plugin: RunnerFactory, dgx1: Topology) -> None:
    manager = ResourceManager(dgx1)
    runner = start_plugin(manager)
    kubelet.wait_for_devices(RESOURCE, 8, WAIT)
    kubelet.restart()  # deletes every socket in the directory, ours too, then serves a new kubelet.sock
    assert kubelet.devices(RESOURCE) == []
    kubelet.wait_for_registrations(RESOURCE, 2, WAIT)
    devices = kubelet.wait_for_devices(RESOURCE, 8, WAIT)
    assert [d.id for d in devices] == list(dgx1.ids)
    assert runner.wait_registered(WAIT, count=2)
    assert sample(manager, "gpuplugin_server_starts_total") >= 2  # served anew after the socket was deleted
    # Admission calls work through the new registration.
    assert len(kubelet.preferred(RESOURCE, list(dgx1.ids), [], 2)) == 2


def test_starts_before_the_kubelet_and_registers_when_it_appears(
    plugin_dir: Path, start_plugin: RunnerFactory, dgx1: Topology
) -> None:
    runner = start_plugin(ResourceManager(dgx1))
    assert runner.serving and not runner.registered
    assert not runner.ready()
    with KubeletSimulator(plugin_dir) as sim:
        sim.wait_for_devices(RESOURCE, 8, WAIT)
        assert runner.wait_registered(WAIT)
        assert sim.registrations(RESOURCE) == 1


def test_socket_deleted_under_running_plugin_is_served_again(
    kubelet: KubeletSimulator, start_plugin: RunnerFactory, dgx1: Topology, plugin_dir: Path
) -> None:
    runner = start_plugin(ResourceManager(dgx1))
    kubelet.wait_for_devices(RESOURCE, 8, WAIT)
    os.unlink(plugin_dir / "gpu-topology.sock")
    kubelet.wait_for_registrations(RESOURCE, 2, WAIT)
    kubelet.wait_for_devices(RESOURCE, 8, WAIT)
    assert runner.serving
    with grpc.insecure_channel(f"unix:{plugin_dir / 'gpu-topology.sock'}") as channel:
        options = pb_grpc.DevicePluginStub(channel).GetDevicePluginOptions(pb.Empty(), timeout=5)
    assert options.get_preferred_allocation_available


def test_stale_socket_file_is_replaced(
    kubelet: KubeletSimulator, start_plugin: RunnerFactory, dgx1: Topology, plugin_dir: Path
) -> None:
    (plugin_dir / "gpu-topology.sock").write_text("left over by a killed plugin")
    start_plugin(ResourceManager(dgx1))
    kubelet.wait_for_devices(RESOURCE, 8, WAIT)


def test_stop_ends_streams_and_removes_socket(
    kubelet: KubeletSimulator, start_plugin: RunnerFactory, dgx1: Topology, plugin_dir: Path
) -> None:
    runner = start_plugin(ResourceManager(dgx1))
    kubelet.wait_for_devices(RESOURCE, 8, WAIT)
    runner.stop()
    assert not (plugin_dir / "gpu-topology.sock").exists()
    # The stream ended, so the kubelet marks the resource's devices unhealthy.
    kubelet.wait_for_devices(RESOURCE, 0, WAIT)
    assert len(kubelet.devices(RESOURCE)) == 8


def test_without_a_kubelet_it_says_it_waits_and_where(tmp_path: Path, dgx1: Topology) -> None:
    """Issue 14, item 7: no silent wait, and a plugin directory nobody made is not created silently."""
    import structlog

    from gpuplugin.deviceplugin.lifecycle import PluginRunner

    with short_dir("dp-") as root:
        plugin_dir = root / "device-plugins"
        with structlog.testing.capture_logs() as logs:
            runner = PluginRunner(ResourceManager(dgx1), plugin_dir, poll_interval=0.05).start()
            try:
                # what it says while it waits is checked below
                eventually(lambda: any(e["event"] == "plugin.kubelet.waiting" for e in logs), WAIT, interval=0.02)
                with KubeletSimulator(plugin_dir) as sim:
                    sim.wait_for_registrations(RESOURCE, 1, WAIT)
                    runner.stop()
            finally:
                runner.stop()
        created = [e for e in logs if e["event"] == "plugin.directory.created"]
        waiting = [e for e in logs if e["event"] == "plugin.kubelet.waiting"]
        assert created and created[0]["path"] == str(plugin_dir) and "kubelet" in created[0]["hint"]
        assert len(waiting) == 1 and waiting[0]["socket"] == str(plugin_dir / "kubelet.sock")


def test_a_directory_no_kubelet_uses_is_warned_about_at_growing_intervals_until_one_comes(
    tmp_path: Path, dgx1: Topology
) -> None:
    """A mistyped --device-plugin-dir is created and waited on forever: said at start, then warned about while no
    kubelet.sock appears, at doubling intervals (never per pass: here a pass runs every 10 ms)."""
    import time

    import structlog

    from gpuplugin.deviceplugin.lifecycle import PluginRunner

    with short_dir("dp-") as root:
        plugin_dir = root / "device-plugnis"
        with structlog.testing.capture_logs() as logs:
            started = time.monotonic()
            runner = PluginRunner(ResourceManager(dgx1), plugin_dir, poll_interval=0.01, kubelet_warn_s=0.1,
                                  kubelet_warn_max_s=0.4).start()
            try:
                def missing() -> list[dict[str, object]]:
                    return [e for e in list(logs) if e["event"] == "plugin.kubelet.missing"]

                assert eventually(lambda: len(missing()) >= 3, WAIT, interval=0.01)
                assert time.monotonic() - started >= 0.1 + 0.2 + 0.4  # doubling: 0.1, then 0.2, then 0.4 later
                with KubeletSimulator(plugin_dir) as sim:
                    sim.wait_for_registrations(RESOURCE, 1, WAIT)
                    said = len(missing())
                    time.sleep(0.5)  # a kubelet is there: no more warnings
                    assert len(missing()) == said
            finally:
                runner.stop()
        created = [e for e in logs if e["event"] == "plugin.directory.created"]
        warned = [e for e in logs if e["event"] == "plugin.kubelet.missing"]
        assert len(created) == 1 and created[0]["log_level"] == "warning"
        assert all(e["log_level"] == "warning" and e["directory_created"] is True for e in warned)
        assert "--device-plugin-dir" in str(warned[0]["hint"]) and warned[0]["socket"] == str(plugin_dir /
                                                                                             "kubelet.sock")
        assert [e["waited_s"] for e in warned] == sorted(e["waited_s"] for e in warned)
