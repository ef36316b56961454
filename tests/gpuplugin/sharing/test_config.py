"""NVIDIA's config file loads unchanged (their documented examples give their resource names and device counts),
bad files are refused naming the field, and the per-node choice follows NVIDIA's config-manager."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuplugin.sharing.config import SharingConfigError, choose_config, parse_config
from gpuplugin.sharing.layout import advertised_counts, resolve
from gputopo.core.topology import Topology
from gputopo.discovery.loader import load_topology_file
from tests.helpers.paths import SHARED

GPU = "nvidia.com/gpu"


@pytest.fixture(scope="module")
def eight() -> Topology:
    return load_topology_file(SHARED / "topologies" / "dgx1-v100-ucxpy.txt")


# NVIDIA/k8s-device-plugin README, "Shared Access to GPUs": each example and what it says a node of 8 GPUs shows.
NVIDIA_EXAMPLES = [
    ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 10\n",
     {GPU: 80}, "time-slicing"),
    ("version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n    - name: nvidia.com/gpu\n"
     "      replicas: 10\n", {"nvidia.com/gpu.shared": 80}, "time-slicing"),
    ("version: v1\nsharing:\n  mps:\n    resources:\n    - name: nvidia.com/gpu\n      replicas: 10\n",
     {GPU: 80}, "mps"),
    ("version: v1\nsharing:\n  mps:\n    renameByDefault: true\n    resources:\n    - name: nvidia.com/gpu\n"
     "      replicas: 10\n", {"nvidia.com/gpu.shared": 80}, "mps"),
    # the README's config-file examples without sharing: whole GPUs, flags accepted and not applied
    ('version: v1\nflags:\n  migStrategy: "none"\n  failOnInitError: true\n  nvidiaDriverRoot: "/"\n  plugin:\n'
     "    passDeviceSpecs: false\n    deviceListStrategy: envvar\n    deviceIDStrategy: uuid\n", {GPU: 8}, None),
    # the GPU operator's time-slicing ConfigMap entry (flags and sharing together)
    ("version: v1\nflags:\n  migStrategy: none\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
     "      replicas: 4\n", {GPU: 32}, "time-slicing"),
]


@pytest.mark.parametrize(("text", "counts", "strategy"), NVIDIA_EXAMPLES)
def test_nvidia_examples_load_unchanged(eight: Topology, text: str, counts: dict[str, int],
                                        strategy: str | None) -> None:
    config = parse_config(text)
    layout = resolve(config, eight, GPU)
    assert advertised_counts(layout, GPU) == counts
    assert layout.strategy == strategy


def test_nvidia_defaults_for_fail_requests_greater_than_one() -> None:
    ts = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n"
    mps = ts.replace("timeSlicing", "mps")
    assert parse_config(ts).fail_requests_greater_than_one is False
    assert parse_config(mps).fail_requests_greater_than_one is True  # v0.20.0: omitted means true for MPS
    explicit = mps.replace("mps:\n", "mps:\n    failRequestsGreaterThanOne: false\n")
    assert parse_config(explicit).fail_requests_greater_than_one is False
    assert parse_config("").strategy is None and parse_config("version: ''").strategy is None


def test_devices_and_rename_give_shared_and_whole_gpus_on_one_node(eight: Topology) -> None:
    text = f"""
version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
      rename: nvidia.com/gpu.shared
      devices: [0, "1"]
    - name: nvidia.com/gpu
      replicas: 7
      rename: nvidia.com/gpu.shared
      devices: ["{eight.gpus[7].id}"]
"""
    layout = resolve(parse_config(text), eight, GPU)
    assert layout.whole == (2, 3, 4, 5, 6)
    assert [(s.name, s.replicas) for s in layout.shared] == [("nvidia.com/gpu.shared", ((0, 4), (1, 4), (7, 7)))]
    assert advertised_counts(layout, GPU) == {GPU: 5, "nvidia.com/gpu.shared": 15}
    count = resolve(parse_config(text.replace('devices: [0, "1"]', "devices: 2")), eight, GPU)
    assert count.whole == (2, 3, 4, 5, 6)


BAD = [
    ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 1}\n",
     "sharing.timeSlicing.resources[0].replicas", "replicas must be from 2"),
    ("version: v2\n", "version", "unknown config version 'v2'"),
    ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n"
     "  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2}\n", "sharing", "both set"),
    ("version: v1\nsharing:\n  timeSlicing:\n    resources: []\n", "sharing.timeSlicing.resources", "at least 1"),
    ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replicas: 2, colour: red}\n",
     "sharing.timeSlicing.resources[0].colour", "Extra inputs"),
    ("version: v1\nsharing:\n  mps:\n    resources:\n    - {name: nvidia.com/gpu, replicas: two}\n",
     "sharing.mps.resources[0].replicas", "integer"),
    ("- a list\n", "", "must be a mapping"),
    ("version: v1\nsharing: [\n", "", "not valid YAML"),
]


@pytest.mark.parametrize(("text", "field", "message"), BAD)
def test_bad_files_are_refused_naming_the_field(text: str, field: str, message: str) -> None:
    with pytest.raises(SharingConfigError) as e:
        parse_config(text, "cm/default")
    assert e.value.field == field
    assert message in str(e.value) and str(e.value).startswith("cm/default: ")


BAD_ON_NODE = [
    ("devices: [8]", "sharing.timeSlicing.resources[0].devices[0]", "GPU index 8 is not on this node"),
    ("devices: [GPU-nope]", "sharing.timeSlicing.resources[0].devices[0]", "no GPU 'GPU-nope'"),
    ("devices: ['0:1']", "sharing.timeSlicing.resources[0].devices[0]", "MIG device"),
    ("devices: 9", "sharing.timeSlicing.resources[0].devices", "asks for 9 GPUs"),
    ("devices: [1, 1]", "sharing.timeSlicing.resources[0].devices[1]", "listed twice"),
    ("devices: [0, 1]", "sharing.timeSlicing.resources[0].rename", "rename clash"),
]


@pytest.mark.parametrize(("devices", "field", "message"), BAD_ON_NODE)
def test_bad_devices_and_rename_clash(eight: Topology, devices: str, field: str, message: str) -> None:
    text = ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
            f"    - {{name: nvidia.com/gpu, replicas: 2, {devices}}}\n")
    with pytest.raises(SharingConfigError) as e:
        resolve(parse_config(text), eight, GPU)
    assert e.value.field == field and message in str(e.value)


def test_two_entries_on_one_gpu_and_unshared_resource_are_refused(eight: Topology) -> None:
    text = ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
            "    - {name: nvidia.com/gpu, replicas: 2, rename: a.io/x}\n"
            "    - {name: nvidia.com/gpu, replicas: 3, rename: a.io/y, devices: [3]}\n")
    with pytest.raises(SharingConfigError, match="GPU 3 is already shared by resources\\[0\\]") as e:
        resolve(parse_config(text), eight, GPU)
    assert e.value.field == "sharing.timeSlicing.resources[1].devices"
    mig = "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/mig-1g.5gb, replicas: 2}\n"
    with pytest.raises(SharingConfigError, match=r"only nvidia\.com/gpu") as e:
        resolve(parse_config(mig), eight, GPU)
    assert e.value.field == "sharing.timeSlicing.resources[0].name"


def test_choice_follows_the_label_then_the_default(tmp_path: Path) -> None:
    for name in ("default", "ts", "mps"):
        (tmp_path / name).write_text("version: v1\n")
    (tmp_path / "..data").mkdir()  # the kubelet's ConfigMap machinery is not a config
    assert choose_config(tmp_path, "ts", None).name == "ts"
    assert choose_config(tmp_path, None, None).name == "default"
    assert choose_config(tmp_path, "", "mps").name == "mps"
    with pytest.raises(SharingConfigError, match="'other', which is not among"):
        choose_config(tmp_path, "other", None)
    (tmp_path / "default").unlink()
    with pytest.raises(SharingConfigError, match="no default"):
        choose_config(tmp_path, None, None)
    (tmp_path / "mps").unlink()
    assert choose_config(tmp_path, None, None).name == "ts"  # the only one
    assert choose_config(None, "ts", None).name is None
