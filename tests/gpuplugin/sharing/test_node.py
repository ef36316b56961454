"""The node's sharing layout served to the kubelet simulator from real config files and a node label: a label
change re-advertises, a change that would drop a device in use waits for the pod to end (PodResources), a bad file
keeps the last good config, a kubelet restart with shared pods held gets every resource back, MPS sets wait for
their daemon, and the state's sharing member counts the replicas held."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuplugin.deviceplugin.lifecycle import PluginRunner
from gpuplugin.deviceplugin.resource import ResourceManager
from gpuplugin.podresources import PodResourcesClient
from gpuplugin.sharing.mps import PID_FILE, MpsDaemon, MpsShare
from gpuplugin.sharing.node import ConfigSource, SharingNode
from gputopo.contract import replica_id
from gputopo.core.codec import NodeState, state_from_json, state_to_json
from gputopo.core.topology import Topology
from gputopo.discovery.loader import load_topology_file
from sim.kubelet import KubeletSimulator
from tests.fakes.kubelet_podresources import PodResourcesServer
from tests.gpuplugin.deviceplugin.conftest import DGX1
from tests.helpers.paths import REPO, short_dir

GPU, SHARED = "nvidia.com/gpu", "nvidia.com/gpu.shared"
WAIT = 10.0
FAKE_MPS = (sys.executable, str(REPO / "tests" / "helpers" / "mps_control.py"))
TS = """version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      rename: nvidia.com/gpu.shared
      replicas: 4
      devices: {devices}
"""


@pytest.fixture(scope="module")
def dgx1() -> Topology:
    return load_topology_file(DGX1)


class Label:
    """The node label as the API would answer it (the reader run.py builds calls get_node)."""

    def __init__(self) -> None:
        self.value: str | None = None

    def __call__(self) -> str | None:
        return self.value


@pytest.fixture
def pods() -> Iterator[PodResourcesServer]:
    with short_dir("pr-") as d, PodResourcesServer(str(d / "kubelet.sock")) as server:
        yield server


def _node(dgx1: Topology, plugin_dir: Path, configs: Path, label: Label, pods: PodResourcesServer,
          **kw: object) -> tuple[SharingNode, PodResourcesClient]:
    client = PodResourcesClient(pods.socket_path)

    def serve(m: ResourceManager, resource: str, socket: str) -> PluginRunner:
        return PluginRunner(m, plugin_dir, resource, socket, backoff_initial=0.05, backoff_max=0.5).start()

    node = SharingNode(ResourceManager(dgx1), GPU, "gpu-topology.sock", serve, ConfigSource(configs, None, label),
                       in_use=client.in_use, poll_interval_s=3600, **kw)  # type: ignore[arg-type]
    return node, client


def test_label_file_changes_are_applied_without_a_pod_losing_its_devices(
    kubelet: KubeletSimulator, plugin_dir: Path, tmp_path: Path, dgx1: Topology, pods: PodResourcesServer
) -> None:
    (tmp_path / "default").write_text("version: v1\n")
    (tmp_path / "ts").write_text(TS.format(devices="[0, 1]"))
    label = Label()
    node, client = _node(dgx1, plugin_dir, tmp_path, label, pods)
    node.start()
    try:
        kubelet.wait_for_devices(GPU, 8, WAIT)
        label.value = "ts"
        node.step()
        shared = kubelet.wait_for_devices(SHARED, 8, WAIT)
        assert {d.id for d in shared} == {replica_id(dgx1.gpus[i].id, n) for i in (0, 1) for n in range(4)}
        kubelet.wait_for_devices(GPU, 6, WAIT)
        # a pod holds GPU 2 whole and a replica of GPU 0: moving the shared set to GPUs 2 and 3 must wait
        pods.service.set_pod("default", "train", {"c": {GPU: [dgx1.gpus[2].id]}})
        pods.service.set_pod("default", "nb", {"c": {SHARED: [replica_id(dgx1.gpus[0].id, 1)]}})
        (tmp_path / "ts").write_text(TS.format(devices="[2, 3]"))
        applied = node.applied
        node.step()
        assert node.applied == applied and node.layout is not None
        assert node.layout.shared[0].gpus == (0, 1)
        pods.service.remove_pod("default", "train")
        node.step()
        assert node.applied == applied  # the notebook still holds GPU 0's replica
        pods.service.remove_pod("default", "nb")
        node.step()
        assert node.applied == applied + 1
        shared = kubelet.wait_until(SHARED, lambda ds: {d.id.split("::")[0] for d in ds} ==
                                    {dgx1.gpus[2].id, dgx1.gpus[3].id} and len(ds) == 8, WAIT)
        kubelet.wait_until(GPU, lambda ds: sorted(d.id for d in ds if d.healthy) ==
                           sorted(g.id for g in dgx1.gpus if g.index not in (2, 3)), WAIT)
        # a bad file keeps the last good config; an unknown label value too
        (tmp_path / "ts").write_text(TS.format(devices="[2, 3]").replace("replicas: 4", "replicas: 1"))
        node.step()
        assert node.applied == applied + 1
        label.value = "nope"
        node.step()
        assert node.applied == applied + 1 and node.layout.shared[0].gpus == (2, 3)
        # label removed: the default (no sharing) comes back
        label.value = None
        node.step()
        kubelet.wait_for_devices(GPU, 8, WAIT)
        assert node.layout.shared == ()
    finally:
        node.stop()
        client.close()


def test_kubelet_restart_with_shared_pods_held(
    kubelet: KubeletSimulator, plugin_dir: Path, tmp_path: Path, dgx1: Topology, pods: PodResourcesServer
) -> None:
    (tmp_path / "ts").write_text(TS.format(devices="[0, 1, 2]"))
    node, client = _node(dgx1, plugin_dir, tmp_path, Label(), pods)
    node.start()
    try:
        kubelet.wait_for_devices(SHARED, 12, WAIT)
        kubelet.wait_for_devices(GPU, 5, WAIT)
        held = [replica_id(dgx1.gpus[0].id, 0), replica_id(dgx1.gpus[1].id, 0)]
        kubelet.allocate(SHARED, held)
        pods.service.set_pod("default", "infer", {"c": {SHARED: held}})
        sharing = node.sharing(client.in_use())
        assert sharing is not None
        assert [(g.gpu, g.replicas, g.used) for g in sharing.resources[0].gpus] == [
            (dgx1.gpus[0].id, 4, 1), (dgx1.gpus[1].id, 4, 1), (dgx1.gpus[2].id, 4, 0)]
        state = NodeState(3, frozenset({dgx1.gpus[4].id}), frozenset(), sharing)
        assert state_from_json(state_to_json(state)) == state  # what the extender reads
        kubelet.restart()
        kubelet.wait_for_registrations(SHARED, 2, WAIT)
        kubelet.wait_for_registrations(GPU, 2, WAIT)
        kubelet.wait_for_devices(SHARED, 12, WAIT)
        kubelet.wait_for_devices(GPU, 5, WAIT)
        resp = kubelet.allocate(SHARED, [replica_id(dgx1.gpus[2].id, 3)])
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == dgx1.gpus[2].id
        node.set_health([dgx1.gpus[1].id], False)  # a GPU failing takes its replicas with it
        kubelet.wait_for_devices(SHARED, 8, WAIT)
        assert node.unhealthy_ids() == [dgx1.gpus[1].id]
        assert node.labels()["nvidia.com/gpu.replicas"] == "4"
        assert node.labels()["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
    finally:
        node.stop()
        client.close()


def test_mps_set_runs_its_daemon_and_hands_out_its_pipe(
    kubelet: KubeletSimulator, plugin_dir: Path, tmp_path: Path, dgx1: Topology, pods: PodResourcesServer
) -> None:
    (tmp_path / "mps").write_text("version: v1\nsharing:\n  mps:\n    resources:\n"
                                  "    - {name: nvidia.com/gpu, replicas: 2}\n")
    with short_dir("mps-") as root:
        pid_file = root / GPU / "pipe" / PID_FILE
        node, client = _node(dgx1, plugin_dir, tmp_path, Label(), pods, mps_root=root, mps_command=FAKE_MPS,
                             mps_interval_s=0.05)
        node.start()
        try:
            kubelet.wait_for_devices(GPU, 16, 15.0)  # replicas under the unrenamed name, healthy once MPS answers
            resp = kubelet.allocate(GPU, [replica_id(dgx1.gpus[5].id, 1)])
            assert resp.envs["CUDA_MPS_PIPE_DIRECTORY"] == str(root / GPU / "pipe")
            assert resp.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
            assert node.labels()["nvidia.com/gpu.product"] is None or node.labels()["nvidia.com/gpu.product"].endswith(
                "-SHARED")
            assert node.labels()["nvidia.com/mps.capable"] == "true"
            pid = pid_file.read_text()
        finally:
            node.stop()
            client.close()
        # the plugin stopped; the daemon serves its clients on, and the restarted plugin adopts it
        assert pid_file.read_text() == pid
        restarted, client = _node(dgx1, plugin_dir, tmp_path, Label(), pods, mps_root=root, mps_command=FAKE_MPS,
                                  mps_interval_s=0.05)
        restarted.start()
        try:
            kubelet.wait_for_devices(GPU, 16, 15.0)
            assert pid_file.read_text() == pid
        finally:
            restarted.stop()
            client.close()
            MpsDaemon(MpsShare(GPU, root, ()), lambda ok: None, command=FAKE_MPS).quit()  # the uninstall path
        assert not pid_file.exists()


def test_an_mps_set_in_use_is_not_replaced_under_its_clients(
    kubelet: KubeletSimulator, plugin_dir: Path, tmp_path: Path, dgx1: Topology, pods: PodResourcesServer
) -> None:
    mps = "version: v1\nsharing:\n  mps:\n    renameByDefault: true\n    resources:\n" \
          "    - {{name: nvidia.com/gpu, replicas: {n}, devices: [0, 1]}}\n"
    (tmp_path / "mps").write_text(mps.format(n=2))
    with short_dir("mps-") as root:
        node, client = _node(dgx1, plugin_dir, tmp_path, Label(), pods, mps_root=root, mps_command=FAKE_MPS,
                             mps_interval_s=0.05)
        node.start()
        try:
            kubelet.wait_for_devices(SHARED, 4, 15.0)
            pods.service.set_pod("default", "infer", {"c": {SHARED: [replica_id(dgx1.gpus[0].id, 0)]}})
            (tmp_path / "mps").write_text(mps.format(n=4))  # more replicas: the ids in use stay, the daemon not
            applied = node.applied
            node.step()
            assert node.applied == applied
            pods.service.remove_pod("default", "infer")
            node.step()
            assert node.applied == applied + 1
            kubelet.wait_for_devices(SHARED, 8, 15.0)
        finally:
            node.stop()
            client.close()


def test_external_mps_daemons_are_asked_for_in_the_desired_file_never_started_here(
    kubelet: KubeletSimulator, plugin_dir: Path, tmp_path: Path, dgx1: Topology, pods: PodResourcesServer
) -> None:
    """--mps-daemons external: the node writes its MPS sets to the desired-state file and starts no daemon, its
    replicas unhealthy until one answers (here the keeper, in-process); a replaced set gets a new generation, and a
    restarted node keeps the generation the file holds."""
    from gpuplugin.sharing.desired import read_desired
    from gpuplugin.sharing.keeper import MpsKeeper

    mps = "version: v1\nsharing:\n  mps:\n    renameByDefault: true\n    resources:\n" \
          "    - {{name: nvidia.com/gpu, replicas: {n}, devices: [0, 1]}}\n"
    (tmp_path / "mps").write_text(mps.format(n=2))
    with short_dir("mps-") as root:
        node, client = _node(dgx1, plugin_dir, tmp_path, Label(), pods, mps_root=root, mps_command=FAKE_MPS,
                             mps_interval_s=0.05, mps_daemons="external")
        node.start()
        keeper = MpsKeeper(root, command=FAKE_MPS, poll_interval_s=0.05, daemon_interval_s=0.05)
        try:
            wanted = read_desired(root)
            assert wanted is not None and list(wanted) == [SHARED] and wanted[SHARED].generation == 1
            assert [(g.uuid, g.replicas) for g in wanted[SHARED].share.gpus] == [(dgx1.gpus[0].id, 2),
                                                                                   (dgx1.gpus[1].id, 2)]
            kubelet.wait_until(SHARED, lambda ds: len(ds) == 4 and not any(d.healthy for d in ds), WAIT)
            assert not (root / SHARED / "pipe" / PID_FILE).exists()  # the plugin starts none
            keeper.start()
            kubelet.wait_for_devices(SHARED, 4, WAIT)
            (tmp_path / "mps").write_text(mps.format(n=4))  # replaced (no pod holds it): a new generation
            node.step()
            assert read_desired(root)[SHARED].generation == 2  # type: ignore[index]
            kubelet.wait_for_devices(SHARED, 8, WAIT)
        finally:
            node.stop()
            client.close()
        assert read_desired(root)[SHARED].generation == 2  # type: ignore[index]  # a stop leaves the file
        restarted, client = _node(dgx1, plugin_dir, tmp_path, Label(), pods, mps_root=root, mps_command=FAKE_MPS,
                                  mps_interval_s=0.05, mps_daemons="external")
        restarted.start()
        try:
            assert read_desired(root)[SHARED].generation == 2  # type: ignore[index]
            kubelet.wait_for_devices(SHARED, 8, WAIT)
        finally:
            restarted.stop()
            client.close()
            keeper.stop()
            MpsDaemon(MpsShare(SHARED, root, ()), lambda ok: None, command=FAKE_MPS).quit()


def test_only_resources_with_devices_are_registered_as_the_layout_changes(
    kubelet: KubeletSimulator, plugin_dir: Path, tmp_path: Path, dgx1: Topology, pods: PodResourcesServer
) -> None:
    """renameByDefault on every GPU: NVIDIA's plugin registers nvidia.com/gpu.shared only, never nvidia.com/gpu with
    no devices (a capacity of 0 that tooling and people read as broken GPUs)."""
    config = "version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n" \
             "    - {{name: nvidia.com/gpu, replicas: 2, devices: {devices}}}\n"
    (tmp_path / "ts").write_text(config.format(devices="all"))
    node, client = _node(dgx1, plugin_dir, tmp_path, Label(), pods)
    node.start()
    try:
        kubelet.wait_for_devices(SHARED, 16, WAIT)
        assert not (plugin_dir / "gpu-topology.sock").exists() and node.whole_runner is None
        assert GPU not in kubelet.resources() and kubelet.registrations(GPU) == 0
        (tmp_path / "ts").write_text(config.format(devices="[0, 1]"))  # whole GPUs come back: registered again
        node.step()
        kubelet.wait_for_registrations(GPU, 1, WAIT)
        kubelet.wait_for_devices(GPU, 6, WAIT)
        kubelet.wait_for_devices(SHARED, 4, WAIT)
        (tmp_path / "ts").write_text(config.format(devices="all"))  # and gone again: no longer served
        node.step()
        kubelet.wait_for_devices(SHARED, 16, WAIT)
        kubelet.wait_for_devices(GPU, 0, WAIT)
        assert not (plugin_dir / "gpu-topology.sock").exists() and node.runner(GPU) is None
    finally:
        node.stop()
        client.close()
