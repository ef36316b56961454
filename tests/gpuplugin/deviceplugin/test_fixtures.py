"""The plugin over every shared topology fixture and the H200 recording: what the kubelet sees and gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuplugin.commands.run import StartupError, discover
from gpuplugin.config import PluginConfig
from gpuplugin.deviceplugin.resource import ResourceManager
from gputopo.core.allocator import best_subset
from gputopo.discovery.loader import load_topology_file
from sim.kubelet import KubeletSimulator
from tests.gpuplugin.deviceplugin.conftest import H200_RECORDING, RESOURCE, RunnerFactory
from tests.helpers.paths import SHARED

WAIT = 10.0
TOPOLOGIES = sorted((SHARED / "topologies").glob("*.txt"))
COMPLETE = [p for p in TOPOLOGIES if "-PARTIAL" not in p.name] + [H200_RECORDING]
PARTIAL = [p for p in TOPOLOGIES if "-PARTIAL" in p.name]


def test_fixture_lists_are_not_empty() -> None:
    assert len(COMPLETE) >= 15 and len(PARTIAL) == 2


@pytest.mark.parametrize("path", COMPLETE, ids=lambda p: p.stem)
def test_plugin_on_fixture(path: Path, kubelet: KubeletSimulator, start_plugin: RunnerFactory) -> None:
    topo = load_topology_file(path)
    start_plugin(ResourceManager(topo))
    devices = kubelet.wait_for_devices(RESOURCE, topo.size, WAIT)
    assert [d.id for d in devices] == list(topo.ids)
    assert [d.numa_nodes for d in devices] == [() if g.numa_node is None else (g.numa_node,) for g in topo.gpus]
    ids = list(topo.ids)
    for size in sorted({1, 2, topo.size // 2, topo.size}):
        answer = kubelet.preferred_raw(RESOURCE, ids, [], size)
        assert answer == [ids[i] for i in best_subset(topo, range(topo.size), size).gpus]
        resp = kubelet.allocate(RESOURCE, answer)
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(answer)


@pytest.mark.parametrize("path", PARTIAL, ids=lambda p: p.stem)
def test_partial_fixture_is_a_clear_startup_error(path: Path) -> None:
    with pytest.raises(StartupError, match=r"cannot load topology: .*" + path.name):
        discover(PluginConfig(topology=path).topology)
