"""NUMA nodes and NVLink islands of GPUs, MIG-enabled ones included, from replayed NVML answers
(gputopo.discovery.nvml.neighbourhood): what the plugin publishes for each MIG GPU so the extender keeps islands
whole."""

from __future__ import annotations

from gputopo.discovery.nvml import neighbourhood
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
