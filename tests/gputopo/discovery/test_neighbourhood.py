"""NUMA nodes and NVLink islands of GPUs, MIG-enabled ones included, from replayed NVML answers
(gputopo.discovery.nvml.neighbourhood): what the plugin publishes for each MIG GPU so the extender keeps islands
whole."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from gputopo.discovery.nvml import neighbourhood
from gputopo.discovery.nvml_backend import LiveNvmlBackend
from gputopo.discovery.nvml_replay import ReplayNvmlBackend
from tests.fixtures.nvml import DGX1, RECORDINGS, canonical

H100_MIXED = RECORDINGS / "synthetic-hgx-h100-80gb-8gpu-mig-mixed.json"


def _backend(recording: dict) -> ReplayNvmlBackend:
    backend = ReplayNvmlBackend(recording)
    backend.init()
    return backend


def _gpus(recording: dict) -> list[tuple[int, str]]:
    return [(g["index"], g["uuid"]) for g in recording["gpus"]]


def test_mig_gpus_on_an_nvswitch_board_share_the_island_of_the_whole_gpus() -> None:
    rec = canonical(H100_MIXED)
    hood = neighbourhood(_backend(rec), _gpus(rec))
    uuids = [u for _, u in _gpus(rec)]
    assert set(hood.islands.values()) == {0} and hood.members == {0: tuple(uuids)}
    # NVML has no NUMA id there (Not Supported): the kernel's, as discovery takes it
    assert hood.numa[uuids[7]] == 5


def test_direct_nvlinks_make_islands_and_a_gpu_without_links_has_none() -> None:
    rec = canonical(DGX1)
    alone = rec["gpus"][7]
    bus = alone["pci_bus_id"]
    alone["nvlinks"] = []
    for g in rec["gpus"]:
        g["nvlinks"] = [lk for lk in g["nvlinks"] if lk.get("remote_bus_id") != bus]
    hood = neighbourhood(_backend(rec), _gpus(rec))
    uuids = [u for _, u in _gpus(rec)]
    assert hood.islands[uuids[7]] is None
    assert {hood.islands[u] for u in uuids[:7]} == {0} and hood.members[0] == tuple(uuids[:7])
    assert {hood.numa[u] for u in uuids[:4]} == {0} and {hood.numa[u] for u in uuids[4:]} == {1}


def test_only_the_gpus_asked_about_are_joined() -> None:
    rec = canonical(DGX1)
    gpus = _gpus(rec)
    hood = neighbourhood(_backend(rec), [gpus[0]])
    assert hood.islands == {gpus[0][1]: None} and hood.members == {}


def _fake_pynvml(bus_ids: list[str]) -> types.SimpleNamespace:
    """Just enough of pynvml for a node whose NVML knows the GPUs' bus ids and no NUMA node (the H200's answer):
    every other call is missing, which the live backend reports as NVML would a failure."""
    def not_supported(*_: Any) -> int:
        raise RuntimeError("Not Supported")

    return types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=bus_ids[h].encode()),
        nvmlDeviceGetNumaNodeId=not_supported)


def test_a_live_node_reads_the_numa_node_nvml_lacks_from_the_injected_sysfs_root(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel names a PCI function with a 4-digit lower-case domain (0000:1b:00.0) where NVML says
    00000000:1B:00.0; -1 there means no node, and a missing file an unknown one."""
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(["00000000:1B:00.0", "00000000:9C:00.0",
                                                             "00000000:AD:00.0"]))
    devices = tmp_path / "bus" / "pci" / "devices"
    for name, node in {"0000:1b:00.0": "1\n", "0000:9c:00.0": "-1\n"}.items():
        (devices / name).mkdir(parents=True)
        (devices / name / "numa_node").write_text(node)
    backend = LiveNvmlBackend(sysfs_root=tmp_path)
    backend.init()
    try:
        hood = neighbourhood(backend, [(0, "GPU-a"), (1, "GPU-b"), (2, "GPU-c")])
    finally:
        backend.shutdown()
    assert hood.numa == {"GPU-a": 1, "GPU-b": None, "GPU-c": None}
