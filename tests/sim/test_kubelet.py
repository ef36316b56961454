"""The kubelet simulator's own kubelet behaviours, checked against hand-written peers that misbehave on purpose
(a plugin that answers outside the candidates, a client that sends a wrong version)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from gpuplugin.proto import deviceplugin_pb2 as pb
from gpuplugin.proto import deviceplugin_pb2_grpc as pb_grpc
from sim.kubelet import KubeletSimulator

WAIT = 10.0


class _SloppyPlugin(pb_grpc.DevicePluginServicer):
    """Answers preferences with an unknown id first and too few ids; lists three devices, then ends its stream."""

    def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DevicePluginOptions:
        return pb.DevicePluginOptions(get_preferred_allocation_available=True)

    def ListAndWatch(self, request: pb.Empty, context: grpc.ServicerContext) -> Iterator[pb.ListAndWatchResponse]:
        yield pb.ListAndWatchResponse(devices=[pb.Device(ID=f"d{i}", health="Healthy") for i in range(3)])

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        return pb.PreferredAllocationResponse(
            container_responses=[pb.ContainerPreferredAllocationResponse(deviceIDs=["zzz", "d2"])]
        )


@pytest.fixture
def sloppy(plugin_dir: Path) -> Iterator[Path]:
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_DevicePluginServicer_to_server(_SloppyPlugin(), server)
    server.add_insecure_port(f"unix:{plugin_dir / 'sloppy.sock'}")
    server.start()
    yield plugin_dir / "sloppy.sock"
    server.stop(0).wait()


def _register(sim: KubeletSimulator, **fields: str) -> grpc.RpcError | None:
    req = pb.RegisterRequest(version="v1beta1", endpoint="sloppy.sock", resource_name="example.com/dev")
    for k, v in fields.items():
        setattr(req, k, v)
    with grpc.insecure_channel(f"unix:{sim.socket_path}") as channel:
        try:
            pb_grpc.RegistrationStub(channel).Register(req, timeout=WAIT)
        except grpc.RpcError as e:
            return e
    return None


def test_kubelet_intersects_and_fills_the_preference(kubelet: KubeletSimulator, sloppy: Path) -> None:
    assert _register(kubelet) is None
    assert kubelet.preferred_raw("example.com/dev", ["d0", "d1", "d2"], [], 2) == ["zzz", "d2"]
    assert kubelet.preferred("example.com/dev", ["d0", "d1", "d2"], [], 2) == ["d2", "d0"]
    assert kubelet.preferred("example.com/dev", ["d0", "d1", "d2"], ["d1"], 2) == ["d1", "d2"]


def test_stream_end_marks_devices_unhealthy(kubelet: KubeletSimulator, sloppy: Path) -> None:
    assert _register(kubelet) is None
    devices = kubelet.wait_until("example.com/dev", lambda ds: len(ds) == 3 and not any(d.healthy for d in ds), WAIT)
    assert [d.id for d in devices] == ["d0", "d1", "d2"]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"version": "v1alpha"}, "not supported"),
        ({"resource_name": "kubernetes.io/gpu"}, "kubernetes.io"),
        ({"resource_name": "gpu"}, "needs a domain"),
        ({"endpoint": "missing.sock"}, "failed to dial"),
    ],
)
def test_register_refusals(plugin_dir: Path, sloppy: Path, fields: dict[str, str], message: str) -> None:
    with KubeletSimulator(plugin_dir, dial_timeout=0.3) as sim:
        err = _register(sim, **fields)
        assert err is not None and err.code() is grpc.StatusCode.UNKNOWN
        assert message in (err.details() or "")
        assert sim.registrations(fields.get("resource_name", "example.com/dev")) == 0


def test_restart_deletes_every_socket(kubelet: KubeletSimulator, plugin_dir: Path) -> None:
    other = socket.socket(socket.AF_UNIX)
    other.bind(str(plugin_dir / "someone-else.sock"))
    other.close()
    (plugin_dir / "checkpoint").write_text("{}")
    kubelet.restart()
    assert sorted(p.name for p in plugin_dir.iterdir()) == ["checkpoint", "kubelet.sock"]
