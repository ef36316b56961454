"""Allocate: envvar and CDI strategies, uuid and index ids, device nodes that exist, annotations, and
INVALID_ARGUMENT for ids the plugin cannot give."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from gpuplugin.deviceplugin.resource import ResourceManager
from gpuplugin.proto import deviceplugin_pb2 as pb
from gpuplugin.proto import deviceplugin_pb2_grpc as pb_grpc
from gputopo.contract import Keys
from gputopo.core.allocator import allreduce_gbps
from gputopo.core.topology import Topology
from sim.kubelet import AdmissionError, KubeletSimulator
from tests.gpuplugin.deviceplugin.conftest import RESOURCE, RunnerFactory, sample

WAIT = 10.0


@pytest.fixture
def dev_root(tmp_path: Path) -> Path:
    """A fake host /dev with GPU 0 and GPU 1 nodes and two of the three control nodes."""
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (dev / name).touch()
    return tmp_path


def _serve(kubelet: KubeletSimulator, start_plugin: RunnerFactory, manager: ResourceManager) -> None:
    start_plugin(manager)
    kubelet.wait_for_devices(RESOURCE, manager.topology.size, WAIT)


def test_envvar_with_uuids(
    kubelet: KubeletSimulator, start_plugin: RunnerFactory, h200: Topology, dev_root: Path
) -> None:
    _serve(kubelet, start_plugin, ResourceManager(h200, dev_root=dev_root))
    ids = list(h200.ids)
    resp = kubelet.allocate(RESOURCE, list(reversed(ids)))
    assert dict(resp.envs) == {"NVIDIA_VISIBLE_DEVICES": ",".join(ids)}
    assert list(resp.cdi_devices) == []
    assert [(d.container_path, d.host_path, d.permissions) for d in resp.devices] == [
        ("/dev/nvidia0", "/dev/nvidia0", "rw"),
        ("/dev/nvidia1", "/dev/nvidia1", "rw"),
        ("/dev/nvidiactl", "/dev/nvidiactl", "rw"),
        ("/dev/nvidia-uvm", "/dev/nvidia-uvm", "rw"),  # nvidia-uvm-tools does not exist on this host
    ]
    assert resp.annotations["gpu-topology.io/gpus"] == ",".join(ids)
    gbps = float(resp.annotations["gpu-topology.io/allreduce-gbps"])
    assert gbps == pytest.approx(allreduce_gbps(h200, [0, 1]), abs=0.05)
    assert gbps > 100  # NV18 through the NVSwitch, not PCIe


def test_envvar_with_indices(kubelet: KubeletSimulator, start_plugin: RunnerFactory, dgx1: Topology) -> None:
    _serve(kubelet, start_plugin, ResourceManager(dgx1, id_strategy="index", keys=Keys("example.org")))
    resp = kubelet.allocate(RESOURCE, ["5", "4"])
    assert dict(resp.envs) == {"NVIDIA_VISIBLE_DEVICES": "4,5"}
    assert resp.annotations["example.org/gpus"] == "4,5"


def test_index_strategy_uses_nvml_index_and_minor(
    kubelet: KubeletSimulator, start_plugin: RunnerFactory, h200: Topology, dev_root: Path
) -> None:
    """When discovery says GPU 0 of the topology is NVML index 1 with minor 1 (a MIG GPU left out before it)."""
    manager = ResourceManager(h200, id_strategy="index", dev_root=dev_root, minors={0: 1}, nvml_indices={0: 1, 1: 2})
    _serve(kubelet, start_plugin, manager)
    resp = kubelet.allocate(RESOURCE, ["0"])
    assert dict(resp.envs) == {"NVIDIA_VISIBLE_DEVICES": "1"}
    assert resp.devices[0].host_path == "/dev/nvidia1"


@pytest.mark.parametrize("strategy", ["cdi-cri", "cdi"])
def test_cdi_cri(kubelet: KubeletSimulator, start_plugin: RunnerFactory, h200: Topology, dev_root: Path,
                 strategy: str) -> None:
    """The CDI names go in the CDIDevices field only (issue 14, item 7: sent twice, the runtime got them twice);
    `cdi`, the old name, means the same."""
    _serve(kubelet, start_plugin, ResourceManager(h200, list_strategy=strategy, dev_root=dev_root))
    ids = list(h200.ids)
    resp = kubelet.allocate(RESOURCE, ids)
    assert [d.name for d in resp.cdi_devices] == [f"nvidia.com/gpu={u}" for u in ids]
    assert "NVIDIA_VISIBLE_DEVICES" not in resp.envs
    assert not [k for k in resp.annotations if k.startswith("cdi.k8s.io/")]


def test_cdi_annotations(kubelet: KubeletSimulator, start_plugin: RunnerFactory, h200: Topology,
                         dev_root: Path) -> None:
    _serve(kubelet, start_plugin, ResourceManager(h200, list_strategy="cdi-annotations", dev_root=dev_root))
    ids = list(h200.ids)
    resp = kubelet.allocate(RESOURCE, ids)
    names = [f"nvidia.com/gpu={u}" for u in ids]
    assert list(resp.cdi_devices) == [] and "NVIDIA_VISIBLE_DEVICES" not in resp.envs
    cdi = {k: v for k, v in resp.annotations.items() if k.startswith("cdi.k8s.io/")}
    assert len(cdi) == 1
    ((key, value),) = cdi.items()
    assert value == ",".join(names)
    assert len(key.split("/", 1)[1]) <= 63
    # Deterministic: the kubelet replays checkpointed responses, a fresh answer must agree.
    assert kubelet.allocate(RESOURCE, list(reversed(ids))).annotations == resp.annotations


def test_cdi_with_index_ids_still_names_uuids(
    kubelet: KubeletSimulator, start_plugin: RunnerFactory, h200: Topology
) -> None:
    _serve(kubelet, start_plugin, ResourceManager(h200, list_strategy="cdi-cri", id_strategy="index"))
    resp = kubelet.allocate(RESOURCE, ["1"])
    assert [d.name for d in resp.cdi_devices] == [f"nvidia.com/gpu={h200.ids[1]}"]


def test_no_device_nodes_when_host_has_none(
    kubelet: KubeletSimulator, start_plugin: RunnerFactory, dgx1: Topology, tmp_path: Path
) -> None:
    _serve(kubelet, start_plugin, ResourceManager(dgx1, dev_root=tmp_path))
    assert list(kubelet.allocate(RESOURCE, ["GPU0"]).devices) == []


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        pytest.param(["GPU0", "GPU42"], "unknown device ids: GPU42", id="unknown"),
        pytest.param(["GPU3"], "unhealthy device ids: GPU3", id="unhealthy"),
        pytest.param(["GPU1", "GPU1"], "repeats device ids: GPU1", id="duplicate"),
        pytest.param([], "names no devices", id="empty"),
    ],
)
def test_invalid_argument(
    kubelet: KubeletSimulator, start_plugin: RunnerFactory, dgx1: Topology, ids: list[str], message: str
) -> None:
    manager = ResourceManager(dgx1)
    _serve(kubelet, start_plugin, manager)
    manager.set_health(["GPU3"], healthy=False)
    with pytest.raises(AdmissionError) as err:
        kubelet.allocate(RESOURCE, ids)
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details
    assert sample(manager, "gpuplugin_allocations_total", result="invalid") == 1
    # The plugin keeps serving.
    assert kubelet.allocate(RESOURCE, ["GPU0"]).envs["NVIDIA_VISIBLE_DEVICES"] == "GPU0"
    assert sample(manager, "gpuplugin_allocations_total", result="ok") == 1


def test_prestart_is_empty(
    kubelet: KubeletSimulator, start_plugin: RunnerFactory, dgx1: Topology, plugin_dir: Path
) -> None:
    _serve(kubelet, start_plugin, ResourceManager(dgx1))
    with grpc.insecure_channel(f"unix:{plugin_dir / 'gpu-topology.sock'}") as channel:
        resp = pb_grpc.DevicePluginStub(channel).PreStartContainer(
            pb.PreStartContainerRequest(devices_ids=["GPU0"]), timeout=5
        )
    assert resp == pb.PreStartContainerResponse()
