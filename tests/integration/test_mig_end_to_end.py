"""MIG through `gpuplugin run` as it runs on a node: a real process replaying a MIG recording as NVML
(`--nvml-recording`), the kubelet simulator (real gRPC over unix sockets), the kubelet's PodResources and the
in-process API server. The three strategies on the replayed A100/H100 recordings, whole GPUs beside MIG devices,
Allocate's answer for a MIG device, a kubelet restart with MIG pods held, a re-partition while pods hold instances
(the recording swapped in place, as NVML would show it), and the refusals: `single` on a node that is not uniform,
MPS on a MIG GPU."""

from __future__ import annotations

import json
from pathlib import Path

from gputopo.core import state_from_json
from gputopo.core.mig import A100_80GB
from sim.kubelet import AdmissionError, KubeletSimulator, SimDevice
from tests.fakes.gpunode import GpuNode, gpu_node
from tests.fixtures.nvml import RECORDINGS
from tests.helpers.mig import ALL_1G, BALANCED_80, make_dev_nodes, mig_recording, write_recording
from tests.helpers.polling import eventually

NODE = "mig-node"
GPU = "nvidia.com/gpu"
ME, ONE, TWO, THREE, SEVEN = ("nvidia.com/mig-1g.10gb.me", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-2g.20gb",
                              "nvidia.com/mig-3g.40gb", "nvidia.com/mig-7g.80gb")
A100_SINGLE = RECORDINGS / "synthetic-hgx-a100-80gb-8gpu-mig-single.json"
H100_MIXED = RECORDINGS / "synthetic-hgx-h100-80gb-8gpu-mig-mixed.json"
H100_MIXED_COUNTS = {GPU: 4, ONE: 10, ME: 1, "nvidia.com/mig-1g.20gb": 1, TWO: 1, THREE: 3}
WAIT = 30.0
FAST = ["--mig-poll-interval", "0.2", "--sharing-poll-interval", "0.2"]


def healthy(kubelet: KubeletSimulator) -> dict[str, int]:
    """Allocatable devices per resource, as the node's status would show them."""
    return {name: n for name, devices in kubelet.resources().items() if (n := sum(d.healthy for d in devices))}


def ids(devices: list[SimDevice], *, health: bool | None = None) -> set[str]:
    return {d.id for d in devices if health is None or d.healthy is health}


def caps(minor: int, gi: int, ci: int) -> list[str]:
    """The capability nodes of a MIG device, numbered as the driver numbers them in mig-minors."""
    access = 3 + 135 * minor + 9 * gi
    return [f"/dev/nvidia-caps/nvidia-cap{access}", f"/dev/nvidia-caps/nvidia-cap{access + 1 + ci}"]


def events(node: GpuNode, name: str) -> list[dict[str, object]]:
    """The plugin's structured log events called `name`."""
    out = []
    for line in node.log.read_text(errors="replace").splitlines():
        if f'"{name}"' in line:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def configs(tmp_path: Path, text: str) -> Path:
    directory = tmp_path / "configs"
    directory.mkdir()
    (directory / "default").write_text(text)
    return directory


def published(node: GpuNode) -> str | None:
    """The GPU state annotation the plugin wrote on its Node."""
    obj = node.fake.node(NODE) or {}
    return ((obj.get("metadata") or {}).get("annotations") or {}).get("gpu-topology.io/state")


def hold(node: GpuNode, pod: str, resource: str, device: str) -> None:
    """The kubelet admitted `pod` with `device`: Allocate, then PodResources reports it."""
    node.kubelet.allocate(resource, [device])
    node.podres.service.set_pod("default", pod, {"main": {resource: [device]}})


def test_mixed_from_the_config_files_flag_serves_mig_beside_whole_gpus_and_over_a_kubelet_restart(
        tmp_path: Path) -> None:
    """One plugin process for both: the strategy read from NVIDIA's file, then a kubelet restart with MIG pods
    held (the restart does not depend on where the strategy came from; --mig-strategy mixed as a flag is the
    re-partition test's)."""
    dev = tmp_path / "host"
    make_dev_nodes(dev, ["/dev/nvidia7", *caps(7, 1, 0), "/dev/nvidiactl", "/dev/nvidia-uvm"])
    # NVIDIA's file as teams have it: the strategy in flags.migStrategy, no --mig-strategy given
    directory = configs(tmp_path, "version: v1\nflags:\n  migStrategy: mixed\n")
    with gpu_node(NODE, None, nvml_recording=H100_MIXED,
                  args=["--sharing-config-dir", str(directory), "--dev-root", str(dev), *FAST]) as node:
        kubelet = node.kubelet
        assert eventually(lambda: healthy(kubelet) == H100_MIXED_COUNTS, WAIT), (healthy(kubelet), node.log_tail())
        assert all(d.id.startswith("MIG-") for name in H100_MIXED_COUNTS if name != GPU
                   for d in kubelet.devices(name))
        # each MIG resource is its own registration, on its own socket
        sockets = {p.name for p in (kubelet.plugin_dir).glob("*.sock")}
        assert {"gpu-topology.sock", "gpu-topology-nvidia.com_mig-1g.10gb.me.sock"} <= sockets
        me = kubelet.allocate(ME, ["MIG-b1070100-5e7d-4000-8000-000000000000"])
        assert me.envs["NVIDIA_VISIBLE_DEVICES"] == "MIG-b1070100-5e7d-4000-8000-000000000000"
        assert [d.host_path for d in me.devices] == ["/dev/nvidia7", *caps(7, 1, 0), "/dev/nvidiactl",
                                                      "/dev/nvidia-uvm"]
        whole = kubelet.allocate(GPU, ["GPU-b1000000-5e7d-4000-8000-000000000000"])
        assert whole.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-b1000000-5e7d-4000-8000-000000000000"
        # the state published on the Node reads back as the extender reads it, GPU 7's two compute instances of
        # one 2g GPU instance included
        assert eventually(lambda: published(node) is not None, WAIT), node.log_tail()
        text = published(node)
        gpu7 = next(g for g in state_from_json(text).mig.gpus if g.index == 7)
        assert [i.profile for i in gpu7.instances].count("1c.2g.20gb") == 2, text
        # two 1g.10gb: GPU 5's two (its other slices are partitioned otherwise), not two of GPU 4's seven
        one = [d.id for d in kubelet.devices(ONE)]
        assert sorted(kubelet.preferred_raw(ONE, one, [], 2)) == ["MIG-b1050100-5e7d-4000-8000-000000000000",
                                                                  "MIG-b1050200-5e7d-4000-8000-000000000001"]

        # the kubelet restarts with MIG pods held: every resource registers again, the held instance stays
        hold(node, "infer", ONE, "MIG-b1040300-5e7d-4000-8000-000000000002")
        hold(node, "train", THREE, "MIG-b1060100-5e7d-4000-8000-000000000000")
        kubelet.restart()
        for name in H100_MIXED_COUNTS:
            kubelet.wait_for_registrations(name, 2, WAIT)
        assert eventually(lambda: healthy(kubelet) == H100_MIXED_COUNTS, WAIT), (healthy(kubelet), node.log_tail())
        assert "MIG-b1040300-5e7d-4000-8000-000000000002" in ids(kubelet.devices(ONE), health=True)
        resp = kubelet.allocate(THREE, ["MIG-b1060200-5e7d-4000-8000-000000000001"])
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == "MIG-b1060200-5e7d-4000-8000-000000000001"


def test_the_mig_strategy_setting_wins_over_the_files_flag(tmp_path: Path) -> None:
    directory = configs(tmp_path, "version: v1\nflags:\n  migStrategy: mixed\n")
    with gpu_node(NODE, None, nvml_recording=H100_MIXED,
                  args=["--sharing-config-dir", str(directory), "--mig-strategy", "none", *FAST]) as node:
        node.kubelet.wait_for_devices(GPU, 4, WAIT)
        assert eventually(lambda: node.log.read_text().count('"plugin.sharing.applied"') >= 1, WAIT)
        # The first MIG pass runs before the plugin says it serves (its `mig` member: what that pass serves), and
        # every later pass decides the same on the same layout and setting: no MIG resource, ever started or logged.
        assert eventually(lambda: events(node, "plugin.server.started"), WAIT), node.log_tail()
        assert [e["mig"] for e in events(node, "plugin.server.started")] == [{}], node.log_tail()
        assert events(node, "plugin.mig.resource_started") == [], node.log_tail()
        assert set(node.kubelet.resources()) == {GPU}, node.kubelet.resources()


def test_single_serves_every_instance_of_a_uniform_node_as_nvidia_gpu() -> None:
    with gpu_node(NODE, None, nvml_recording=A100_SINGLE, args=["--mig-strategy", "single", *FAST]) as node:
        devices = node.kubelet.wait_for_devices(GPU, 56, WAIT)
        assert all(d.id.startswith("MIG-a1") for d in devices)
        assert set(node.kubelet.resources()) == {GPU}
        resp = node.kubelet.allocate(GPU, ["MIG-a1030500-5e7d-4000-8000-000000000004"])
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == "MIG-a1030500-5e7d-4000-8000-000000000004"


def test_single_is_refused_on_a_node_that_is_not_uniform_naming_the_layout(tmp_path: Path) -> None:
    recording = write_recording(tmp_path / "rec.json",
                                mig_recording(A100_80GB, [list(ALL_1G)] * 7 + [list(BALANCED_80)]))
    with gpu_node(NODE, None, nvml_recording=recording, args=["--mig-strategy", "single", *FAST]) as node:
        assert eventually(lambda: events(node, "plugin.mig.strategy_refused"), WAIT), node.log_tail()
        refusal = str(events(node, "plugin.mig.strategy_refused")[0]["error"])
        assert "not uniform" in refusal
        assert "GPU-a1000007-5e7d-4000-8000-000000000007: 2x 1g.10gb, 1x 2g.20gb, 1x 3g.40gb" in refusal
        assert node.process.poll() is None and node.kubelet.resources() == {}
    # beside whole GPUs single is refused too, and the whole GPUs are served
    with gpu_node(NODE, None, nvml_recording=H100_MIXED, args=["--mig-strategy", "single", *FAST]) as node:
        node.kubelet.wait_for_devices(GPU, 4, WAIT)
        assert eventually(lambda: "plugin.mig.strategy_refused" in node.log.read_text(), WAIT), node.log_tail()
        assert set(node.kubelet.resources()) == {GPU}


def test_mps_on_a_mig_gpu_is_refused_and_the_rest_is_served(tmp_path: Path) -> None:
    directory = configs(tmp_path, """version: v1
flags:
  migStrategy: mixed
sharing:
  mps:
    resources:
    - name: nvidia.com/gpu
      replicas: 2
      devices: ["GPU-b1000005-5e7d-4000-8000-000000000005"]
""")
    with gpu_node(NODE, None, nvml_recording=H100_MIXED,
                  args=["--sharing-config-dir", str(directory), *FAST]) as node:
        assert eventually(lambda: healthy(node.kubelet) == H100_MIXED_COUNTS, WAIT), node.log_tail()
        assert eventually(lambda: "MIG and MPS on one GPU are refused" in node.log.read_text(), WAIT)
        assert "nvidia.com/gpu.shared" not in node.kubelet.resources()


def test_a_repartition_re_advertises_and_never_takes_away_an_instance_a_pod_holds(tmp_path: Path) -> None:
    before = mig_recording(A100_80GB, [None] * 6 + [list(ALL_1G), list(BALANCED_80)])
    recording = write_recording(tmp_path / "rec.json", before)
    held_one, held_three = "MIG-a1070200-5e7d-4000-8000-000000000001", "MIG-a1070400-5e7d-4000-8000-000000000003"
    with gpu_node(NODE, None, nvml_recording=recording, args=["--mig-strategy", "mixed", *FAST]) as node:
        kubelet = node.kubelet
        assert eventually(lambda: healthy(kubelet) == {GPU: 6, ONE: 9, TWO: 1, THREE: 1}, WAIT), node.log_tail()
        hold(node, "notebook", ONE, held_one)
        hold(node, "infer", THREE, held_three)
        registrations = kubelet.registrations(ONE)
        # GPU 7 re-partitioned as one 7g.80gb (NVML gives the new instance a UUID of its own)
        after = mig_recording(A100_80GB, [None] * 6 + [list(ALL_1G), [("7g.80gb", 0, (7,))]])
        after["gpus"][7]["mig"]["devices"][0]["uuid"] = "MIG-a107f100-5e7d-4000-8000-00000000f000"
        write_recording(recording, after)
        assert eventually(lambda: healthy(kubelet) == {GPU: 6, ONE: 7, SEVEN: 1}, WAIT), (healthy(kubelet),
                                                                                          node.log_tail())
        # the held instances stay advertised, not allocatable, until their pods end; the plugin was not restarted
        assert held_one in ids(kubelet.devices(ONE), health=False)
        assert ids(kubelet.devices(THREE), health=False) == {held_three}
        assert kubelet.registrations(ONE) == registrations
        assert ids(kubelet.devices(SEVEN)) == {"MIG-a107f100-5e7d-4000-8000-00000000f000"}
        node.podres.service.remove_pod("default", "notebook")
        assert eventually(lambda: held_one not in ids(kubelet.devices(ONE)), WAIT), node.log_tail()
        assert ids(kubelet.devices(THREE)) == {held_three}  # still held
        node.podres.service.remove_pod("default", "infer")
        # its resource stops: the kubelet marks what it had Unhealthy (a resource, once seen, stays listed)
        assert eventually(lambda: any(e.get("resource") == THREE for e in events(node, "plugin.mig.resource_stopped")),
                          WAIT), node.log_tail()
        assert THREE not in healthy(kubelet) and node.process.poll() is None


def test_time_slicing_on_mig_instances_through_the_sharing_config(tmp_path: Path) -> None:
    a, b = "MIG-b1040100-5e7d-4000-8000-000000000000", "MIG-b1040200-5e7d-4000-8000-000000000001"
    directory = configs(tmp_path, f"""version: v1
flags:
  migStrategy: mixed
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
    - name: nvidia.com/mig-1g.10gb
      replicas: 3
      devices: ["{a}", "{b}"]
    - name: nvidia.com/gpu
      replicas: 2
      devices: [0]
""")
    shared = "nvidia.com/mig-1g.10gb.shared"
    with gpu_node(NODE, None, nvml_recording=H100_MIXED,
                  args=["--sharing-config-dir", str(directory), *FAST]) as node:
        kubelet = node.kubelet
        want = {**H100_MIXED_COUNTS, GPU: 3, ONE: 8, shared: 6, "nvidia.com/gpu.shared": 2}
        assert eventually(lambda: healthy(kubelet) == want, WAIT), (healthy(kubelet), node.log_tail())
        assert ids(kubelet.devices(shared)) == {f"{u}::{k}" for u in (a, b) for k in range(3)}
        replicas = [d.id for d in kubelet.devices(shared)]
        # a 2-replica request gets two distinct MIG devices (distinctGpus, the default), and Allocate holds to it
        assert {x.split("::")[0] for x in kubelet.preferred_raw(shared, replicas, [], 2)} == {a, b}
        resp = kubelet.allocate(shared, [f"{a}::1"])
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == a
        try:
            kubelet.allocate(shared, [f"{a}::0", f"{a}::2"])
        except AdmissionError as e:
            assert "distinct MIG devices" in e.details
        else:
            raise AssertionError("two replicas of one MIG device were allocated to one container")
