"""Compact topology and state JSON: round trips, size budget, and clear errors for bad or newer documents."""

from __future__ import annotations

import json

import pytest

from gputopo.core import (
    NodeState,
    TopologyFormatError,
    state_from_json,
    state_to_json,
    topology_from_json,
    topology_to_json,
)
from gputopo.core.topology import Gpu, Link, LinkKind, Nic, Topology
from gputopo.discovery.loader import load_topology_file
from tests.conftest import SHARED


def _sixteen_with_nics() -> Topology:
    n = 16
    links = [[None if i == j else Link(LinkKind.NVSWITCH, 18, 4) for j in range(n)] for i in range(n)]
    gpus = [
        Gpu(i, f"GPU-{i:08x}-1815-347d-42f6-f41f43f97e01", f"00000000:{i + 0x10:02X}:00.0", "NVIDIA H200", 143771,
            i // 8, "0-47,96-143" if i < 8 else "48-95,144-191")
        for i in range(n)
    ]
    nics = [Nic(f"mlx5_{k}", tuple(LinkKind.PIX if i // 2 == k else LinkKind.SYS for i in range(n))) for k in range(10)]
    return Topology.build(gpus, links, nics, pcie_generation=5)


def test_sixteen_gpus_with_nics_fit_in_4_kib() -> None:
    text = topology_to_json(_sixteen_with_nics())
    assert len(text.encode()) <= 4096, len(text)
    assert topology_from_json(text) == _sixteen_with_nics()


@pytest.mark.parametrize("path", sorted((SHARED / "topologies").glob("*.txt")), ids=lambda p: p.stem)
def test_fixture_round_trip(path) -> None:
    if "PARTIAL" in path.name:
        pytest.skip("truncated on purpose")
    topo = load_topology_file(path)
    again = topology_from_json(topology_to_json(topo))
    assert again == topo
    assert again.fingerprint == topo.fingerprint
    assert again.bandwidth_mbps == topo.bandwidth_mbps


def _doc() -> dict:
    return json.loads(topology_to_json(_sixteen_with_nics()))


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.update(v=2), "newer than this build reads"),
        (lambda d: d.pop("v"), "no integer version"),
        (lambda d: d.update(gpus=[]), "non-empty list"),
        (lambda d: d["links"].pop(), "must list 120 pairs"),
        (lambda d: d["links"].__setitem__(3, "NV"), "unknown link token"),
        (lambda d: d["links"].__setitem__(3, "WARP9"), "unknown link token"),
        (lambda d: d["gpus"][1].__setitem__(0, d["gpus"][0][0]), "duplicate GPU ids"),
        (lambda d: d["gpus"][1].__setitem__(2, "zero"), "numa node must be int"),
        (lambda d: d["gpus"][1].__setitem__(3, 7), "model reference 7 out of range"),
        (lambda d: d["nics"][0].__setitem__(1, "IIX" + "S" * 13), "unknown PCIe class"),
        (lambda d: d.update(pcie=9), "unknown PCIe generation"),
        (lambda d: d.update(sock=-1), "must be positive"),
    ],
)
def test_malformed_topology_json_names_the_problem(mutate, message) -> None:
    doc = _doc()
    mutate(doc)
    with pytest.raises(TopologyFormatError, match=message):
        topology_from_json(json.dumps(doc))


@pytest.mark.parametrize("text", ["", "{", "[]", "null", "\xff", '{"v": "1"}', "[" * 100_000 + "]" * 100_000])
def test_garbage_is_a_format_error(text) -> None:
    with pytest.raises(TopologyFormatError):
        topology_from_json(text)


def test_state_round_trip_and_errors() -> None:
    state = NodeState(7, frozenset({"GPU-a", "GPU-b"}), frozenset({"GPU-c"}))
    assert state_from_json(state_to_json(state)) == state
    with pytest.raises(TopologyFormatError, match="newer"):
        state_from_json('{"v": 9, "gen": 1, "used": [], "unhealthy": []}')
    with pytest.raises(TopologyFormatError, match="'used' must be a list"):
        state_from_json('{"v": 1, "gen": 1, "used": "GPU-a"}')
    with pytest.raises(TopologyFormatError, match="not JSON"):
        state_from_json("used=GPU-a")
    with pytest.raises(TopologyFormatError, match="not JSON"):
        state_from_json("[" * 100_000)
