"""What the real 2x H200 machine said, recorded with `gpuplugin record` and `nvidia-smi topo -m` (2026-11-30).

The NVML recording must replay to the NVSwitch fabric (remote ends are switches, bus id FFFFFFFF:FF:FF.0), and the
text of the same machine must give the same bandwidths (text cannot tell a switch from direct links).
"""

from __future__ import annotations

from gputopo.core import best_subset
from gputopo.core.topology import LinkKind
from gputopo.discovery.loader import load_topology_file
from tests.fixtures.nvml import FIXTURES
from tests.helpers.paths import SHARED

RECORDING = FIXTURES / "recordings" / "h200x2-nvml-recording.json"
TEXT = FIXTURES / "topologies" / "h200x2-nvidia-smi-topo-m.txt"


def test_live_recording_replays_to_the_nvswitch_fabric() -> None:
    topo = load_topology_file(RECORDING)
    assert topo.size == 2
    assert topo.ids == ("GPU-21063f48-5201-76d2-a581-62e6e06810cf", "GPU-5608f7ff-f092-af84-5ec5-ed6da7d62690")
    link = topo.link(0, 1)
    assert (link.kind, link.lanes, link.generation) == (LinkKind.NVSWITCH, 18, 4)
    assert [g.numa_node for g in topo.gpus] == [None, None]  # NVML says not supported in this VM
    assert topo.gpus[0].model == "NVIDIA H200"
    assert topo.pcie_generation == 5
    assert best_subset(topo, [0, 1], 2).allreduce_gbps == topo.gbps(0, 1)


def test_text_with_ansi_underline_gives_the_same_bandwidths() -> None:
    from_text = load_topology_file(TEXT)
    from_nvml = load_topology_file(RECORDING)
    assert from_text.bandwidth_mbps == from_nvml.bandwidth_mbps
    assert from_text.link(0, 1).lanes == 18


def test_the_shared_probe_of_another_boot_agrees() -> None:
    probe = load_topology_file(SHARED / "recordings" / "h200x2-vm-nvml-probe.json")
    assert probe.bandwidth_mbps == load_topology_file(RECORDING).bandwidth_mbps
