"""Fixtures for the device plugin tests: shared topologies and the real plugin serving in-process over real unix
sockets to the kubelet simulator (`plugin_dir` and `kubelet` come from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpuplugin.deviceplugin.lifecycle import PluginRunner
from gpuplugin.deviceplugin.resource import ResourceManager
from gputopo.core.topology import Topology
from gputopo.discovery.loader import load_topology_file
from tests.helpers.paths import SHARED

RESOURCE = "nvidia.com/gpu"
DGX1 = SHARED / "topologies" / "dgx1-v100-ucxpy.txt"
H200_RECORDING = SHARED / "recordings" / "h200x2-vm-nvml-probe.json"
# 8x A100 on NVSwitch with GPUs on four NUMA nodes.
DGX_A100 = SHARED / "topologies" / "dgx-a100-8gpu-10nic-1mcprddgx05.txt"


@pytest.fixture(scope="session")
def dgx1() -> Topology:
    return load_topology_file(DGX1)


@pytest.fixture(scope="session")
def dgx_a100() -> Topology:
    return load_topology_file(DGX_A100)


@pytest.fixture(scope="session")
def h200() -> Topology:
    return load_topology_file(H200_RECORDING)


RunnerFactory = Callable[..., PluginRunner]


@pytest.fixture
def start_plugin(plugin_dir: Path) -> Iterator[RunnerFactory]:
    """Start the real plugin on `plugin_dir`: start_plugin(manager, **runner_kwargs). Stopped after the test."""
    started: list[PluginRunner] = []

    def start(manager: ResourceManager, **kwargs: object) -> PluginRunner:
        kwargs.setdefault("backoff_initial", 0.05)
        kwargs.setdefault("backoff_max", 0.5)
        runner = PluginRunner(manager, plugin_dir, **kwargs).start()  # type: ignore[arg-type]
        started.append(runner)
        return runner

    yield start
    for runner in started:
        runner.stop()


def sample(manager: ResourceManager, name: str, **labels: str) -> float:
    """A metric sample from the manager's registry (0.0 when absent)."""
    value = manager.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value
