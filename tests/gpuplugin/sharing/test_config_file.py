"""NVIDIA's single-file form as `gpuplugin run` takes it (real process, the kubelet simulator): the file named by
CONFIG_FILE, NVIDIA's own environment variable, is served whatever the node label says, and re-read, so a node
moving from NVIDIA's plugin keeps its DaemonSet's file and variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from gputopo.contract import replica_parent
from tests.fakes.gpunode import gpu_node
from tests.helpers.paths import SHARED

NODE = "dgx1-node"
GPU, SHARED_GPU = "nvidia.com/gpu", "nvidia.com/gpu.shared"
DGX1 = SHARED / "topologies" / "dgx1-v100-ucxpy.txt"
WAIT = 30.0
CONFIG = """version: v1
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
    - name: nvidia.com/gpu
      replicas: 3
      devices: {devices}
"""


def test_the_file_in_config_file_is_served_and_re_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(devices="[4, 5, 6, 7]"))
    monkeypatch.setenv("CONFIG_FILE", str(config))
    with gpu_node(NODE, DGX1, args=["--sharing-poll-interval", "0.2", "--device-id-strategy", "index"]) as node:
        kubelet = node.kubelet
        shared = kubelet.wait_for_devices(SHARED_GPU, 12, WAIT)
        assert {replica_parent(d.id)[0] for d in shared} == {"4", "5", "6", "7"}, node.log_tail()
        kubelet.wait_for_devices(GPU, 4, WAIT)
        config.write_text(CONFIG.format(devices="all"))  # every GPU shared: nothing is left whole
        kubelet.wait_for_devices(SHARED_GPU, 24, WAIT)
        kubelet.wait_for_devices(GPU, 0, WAIT)
