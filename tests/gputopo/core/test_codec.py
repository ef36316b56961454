"""Compact topology and state JSON: round trips, size budget, and clear errors for bad or newer documents."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputopo.contract import ReplicaIdError, replica_id, replica_parent
from gputopo.core import (
    NodeState,
    SharedGpu,
    SharedResource,
    Sharing,
    TopologyError,
    TopologyFormatError,
    state_from_json,
    state_to_json,
    topology_from_json,
    topology_to_json,
)
from gputopo.core.codec import Mig, MigGpuInfo, MigInstance
from gputopo.core.topology import Gpu, Link, LinkKind, Nic, Topology
from gputopo.discovery.loader import load_topology_file
from tests.helpers.paths import SHARED


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


def _with_nic_attributes() -> Topology:
    topo = _sixteen_with_nics()
    nics = [Nic(n.name, n.gpu_links, k % 2 == 0, 400.0 if k < 8 else None) for k, n in enumerate(topo.nics)]
    return Topology.build(topo.gpus, topo.links, nics, topo.pcie_generation, topo.socket_link_gbps)


def test_nic_attributes_round_trip_and_still_fit_in_4_kib() -> None:
    topo = _with_nic_attributes()
    text = topology_to_json(topo)
    assert len(text.encode()) <= 4096, len(text)
    again = topology_from_json(text)
    assert [(n.rdma, n.link_gbit) for n in again.nics] == [(n.rdma, n.link_gbit) for n in topo.nics]
    assert again.network_gbps == topo.network_gbps


def test_nic_rows_of_a_reader_before_attributes_stay_readable_both_ways() -> None:
    """Written before 'nicattr' existed: NICs read with unknown attributes. Written now: the rows an older reader
    validates ([name, letters]) are unchanged, and the attributes ride in a key it ignores."""
    doc = json.loads(topology_to_json(_with_nic_attributes()))
    assert all(isinstance(row, list) and len(row) == 2 for row in doc["nics"])
    doc.pop("nicattr")
    old = topology_from_json(json.dumps(doc))
    assert all(n.rdma is None and n.link_gbit is None for n in old.nics)
    plain = json.loads(topology_to_json(Topology.build(old.gpus, old.links, old.nics)))
    assert "nicattr" not in plain  # nothing known, nothing written


@pytest.mark.parametrize(
    ("attrs", "message"),
    [
        ("x", "'nicattr' must list 10 entries"),
        ([[1, 400]] * 9, "'nicattr' must list 10 entries"),
        ([[1, 400, 3]] * 10, r"nicattr\[0\] must be \[rdma, link Gb/s\]"),
        ([[2, 400]] * 10, r"nicattr\[0\] rdma must be 1, 0 or null"),
        ([[0.5, 400]] * 10, r"nicattr\[0\] rdma must be 1, 0 or null"),
        ([[1, "400"]] * 10, r"nicattr\[0\] link rate must be a number"),
        ([[1, True]] * 10, r"nicattr\[0\] link rate must be a number"),
        ([[1, -5]] * 10, r"nics\[0\]: NIC mlx5_0 link rate must be"),
        ([[1, 1e9]] * 10, r"nics\[0\]: NIC mlx5_0 link rate must be"),
    ],
)
def test_bad_nic_attributes_are_named(attrs, message) -> None:
    doc = _doc()
    doc["nicattr"] = attrs
    with pytest.raises(TopologyFormatError, match=message):
        topology_from_json(json.dumps(doc))


def test_too_many_nics_are_refused() -> None:
    doc = _doc()
    doc["nics"] = doc["nics"] * 30
    with pytest.raises(TopologyFormatError, match="at most 256"):
        topology_from_json(json.dumps(doc))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "", "gpu_links": (LinkKind.PIX,)}, "needs a name"),
        ({"name": "m", "gpu_links": (LinkKind.NVLINK,)}, "over PCIe only, not NVLINK"),
        ({"name": "m", "gpu_links": (LinkKind.PIX,), "link_gbit": 0.0}, "link rate must be"),
        ({"name": "m", "gpu_links": (LinkKind.PIX,), "link_gbit": float("inf")}, "link rate must be"),
        ({"name": "m", "gpu_links": (LinkKind.PIX,), "link_gbit": True}, "link rate must be"),
    ],
)
def test_nics_refuse_what_no_nic_is(kwargs, message) -> None:
    with pytest.raises(TopologyError, match=message):
        Nic(**kwargs)


def _sharing() -> Sharing:
    return Sharing("mps", True, (
        SharedResource("nvidia.com/gpu", (SharedGpu("GPU-c", 4, 1), SharedGpu("GPU-d", 4, 4))),
        SharedResource("nvidia.com/gpu.small", (SharedGpu("GPU-e", 8, 0),)),
    ))


def test_sharing_state_round_trips_and_old_documents_read_as_unshared() -> None:
    state = NodeState(3, frozenset({"GPU-a"}), frozenset(), _sharing())
    assert state_from_json(state_to_json(state)) == state
    assert state.sharing is not None and state.sharing.shared_gpus == {"GPU-c", "GPU-d", "GPU-e"}
    assert state.sharing.resource("nvidia.com/gpu.small").gpus[0].free == 8
    assert "sharing" not in json.loads(state_to_json(NodeState(1, frozenset(), frozenset())))
    assert state_from_json('{"v": 1, "gen": 1, "used": [], "unhealthy": []}').sharing is None


def _shared(**change) -> str:
    body = json.loads(state_to_json(NodeState(3, frozenset({"GPU-a"}), frozenset(), _sharing())))
    body["sharing"].update(change)
    return json.dumps(body)


@pytest.mark.parametrize(("text", "message"), [
    (_shared(strategy="mig"), "'strategy' must be one of time-slicing, mps"),
    (_shared(failRequestsGreaterThanOne="yes"), "must be a boolean"),
    (_shared(resources=[]), "must list 1-64 resources"),
    (_shared(resources=[{"name": "nvidia.com/gpu", "gpus": [["GPU-c", 4, 5]]}]), "used must be an integer from 0 to 4"),
    (_shared(resources=[{"name": "nvidia.com/gpu", "gpus": [["GPU-c", 0, 0]]}]), "replicas must be an integer from 1"),
    (_shared(resources=[{"name": "nvidia.com/gpu", "gpus": [["GPU-c", 4]]}]), r"must be \[gpu id, replicas, used\]"),
    (_shared(resources=[{"name": "r", "gpus": [["GPU-c", 2, 0]]}, {"name": "r", "gpus": [["GPU-d", 2, 0]]}]),
     "listed twice"),
    (_shared(resources=[{"name": "r", "gpus": [["GPU-c", 2, 0]]}, {"name": "s", "gpus": [["GPU-c", 2, 0]]}]),
     "shared under two entries"),
    (_shared(resources=[{"name": "r", "gpus": [["GPU-a", 2, 0]]}]), "shared GPU 'GPU-a' as used whole"),
])
def test_bad_sharing_is_named(text: str, message: str) -> None:
    with pytest.raises(TopologyFormatError, match=message):
        state_from_json(text)


def test_replica_ids_are_nvidias() -> None:
    assert replica_id("GPU-a", 3) == "GPU-a::3"
    assert replica_parent("GPU-a::3") == ("GPU-a", 3)
    assert replica_parent("MIG-x::y::12") == ("MIG-x::y", 12)
    for bad in ("GPU-a", "GPU-a::", "::3", "GPU-a::-1", "GPU-a::03", "GPU-a::x"):
        with pytest.raises(ReplicaIdError, match="not a replica id"):
            replica_parent(bad)


# -- the "mig" member (issue 23) --------------------------------------------------------------------------------------


def _mig() -> Mig:
    gpu = MigGpuInfo("GPU-m", 2, 1, None, "NVIDIA H200", (
        MigInstance("3g.71gb", 0, 4, "MIG-a", "nvidia.com/mig-3g.71gb", True),
        MigInstance("1c.2g.35gb", 4, 2, "MIG-b", None, False),
        MigInstance("1g.18gb", 6, 1, "MIG-c", "nvidia.com/mig-1g.18gb", False),
    ))
    return Mig("mixed", None, (gpu,))


def test_mig_state_round_trips_and_old_documents_read_without_it() -> None:
    state = NodeState(4, frozenset({"GPU-a"}), frozenset(), None, _mig())
    assert state_from_json(state_to_json(state)) == state
    assert state.mig is not None and state.mig.used_ids == {"MIG-a"}
    assert "mig" not in json.loads(state_to_json(NodeState(1, frozenset(), frozenset())))
    assert state_from_json('{"v": 1, "gen": 1, "used": [], "unhealthy": []}').mig is None
    off = Mig("none", "MIG devices are not advertised by this plugin (MIG strategy none)", (MigGpuInfo(
        "GPU-n", 0, None, None, None, (MigInstance("7g.141gb", 0, 8, "MIG-z", None, False),)),))
    assert state_from_json(state_to_json(NodeState(1, frozenset(), frozenset(), None, off))).mig == off


def test_compute_instances_of_one_gpu_instance_share_its_placement() -> None:
    """Two 1c.2g compute instances of one 2g GPU instance are two MIG devices at one placement (the H100 mixed
    recording's GPU 7): the extender must read that state."""
    gpu = MigGpuInfo("GPU-m", 7, 0, None, "NVIDIA H100 80GB HBM3", (
        MigInstance("1c.2g.20gb", 4, 2, "MIG-a", None, False),
        MigInstance("1c.2g.20gb", 4, 2, "MIG-b", None, True),
        MigInstance("3g.40gb", 0, 4, "MIG-c", "nvidia.com/mig-3g.40gb", False),
    ))
    state = NodeState(2, frozenset(), frozenset(), None, Mig("mixed", None, (gpu,)))
    assert state_from_json(state_to_json(state)) == state


def _migged(gpu: dict | None = None, **change) -> str:
    body = json.loads(state_to_json(NodeState(3, frozenset({"GPU-a"}), frozenset(), None, _mig())))
    body["mig"].update(change)
    if gpu is not None:
        body["mig"]["gpus"][0].update(gpu)
    return json.dumps(body)


@pytest.mark.parametrize(("text", "message"), [
    (_migged(v=2), "state mig version 2 is newer than this build reads"),
    (_migged(v="1"), "no integer version"),
    (_migged(strategy="dynamic"), "'strategy' must be one of none, single, mixed"),
    (_migged(strategy="none"), "strategy 'none' advertises no resource"),
    (_migged(reason="x" * 500), "'reason' must be null or a string of 1-400"),
    (_migged(gpus={}), "'gpus' must list at most 64"),
    (_migged(gpus=[{}] * 65), "'gpus' must list at most 64"),
    (_migged({"index": -1}), r"gpus\[0\] 'index' must be an integer from 0"),
    (_migged({"numa": "0"}), r"'numa' must be an integer"),
    (_migged({"gpu": ""}), r"'gpu' must be a string of 1-128"),
    (_migged({"instances": [["1g.18gb", 0, 1, "u", None, 0]] * 9}), "'instances' must list at most 8"),
    (_migged({"instances": [["1g.18gb", 0, 1, "u"]]}), r"instances\[0\] must be \[device name, start"),
    (_migged({"instances": [["9g.1gb", 0, 1, "u", None, 0]]}), "is not a MIG profile name"),
    (_migged({"instances": [["1g.18gb", 7, 2, "u", None, 0]]}), "is not within the 8 memory slices"),
    (_migged({"instances": [["1g.18gb", 0, 1, "u", None, 2]]}), "used must be 1 or 0"),
    (_migged({"instances": [["1g.18gb", 0, 1, "u", "mig-1g", 0]]}), "resource must be domain/name"),
    (_migged({"instances": [["1g.18gb", 0, 1, "u", None, 0], ["2g.35gb", 0, 2, "w", None, 0]]}),
     "overlaps another instance"),
    (_migged({"instances": [["1g.18gb", 0, 1, "u", None, 0], ["1g.18gb", 1, 1, "u", None, 0]]}), "listed twice"),
    # compute instances share their GPU instance's placement, within its slices, and nothing else's
    (_migged({"instances": [["1c.2g.35gb", 0, 2, "u", None, 0], ["1c.2g.35gb", 0, 2, "w", None, 0],
                            ["1c.2g.35gb", 0, 2, "x", None, 0]]}), "take more than its 2 slices"),
    (_migged({"instances": [["2g.35gb", 0, 2, "u", None, 0], ["1c.2g.35gb", 0, 2, "w", None, 0]]}),
     "overlaps another instance"),
    (_migged({"instances": [["1c.2g.35gb", 0, 2, "u", None, 0], ["1c.2g.35gb", 1, 2, "w", None, 0]]}),
     "overlaps another instance"),
    (_migged({"instances": [["1c.2g.35gb", 0, 2, "u", None, 0], ["1c.3g.35gb", 0, 2, "w", None, 0]]}),
     "a compute instance of a 3-slice GPU instance where another names 2"),
    (_migged({"instances": [["1g.18gb", 0, 1, "u", "x/r", 0], ["2g.35gb", 2, 2, "w", "x/r", 0]]}),
     "serves both 1g.18gb and 2g.35gb"),
    (_migged({"gpu": "GPU-a"}), "MIG GPU 'GPU-a' as used whole"),
])
def test_bad_mig_is_named(text: str, message: str) -> None:
    with pytest.raises(TopologyFormatError, match=message):
        state_from_json(text)


_json = st.recursive(st.none() | st.booleans() | st.integers(-3, 300) | st.text(max_size=12),
                     lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner,
                                                                                  max_size=5), max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(st.one_of(_json, st.fixed_dictionaries({"v": st.just(1), "strategy": st.sampled_from(["mixed", "none"]),
                                                "gpus": st.lists(st.dictionaries(st.sampled_from(
                                                    ["gpu", "index", "numa", "island", "model", "instances"]),
                                                    _json), max_size=3)})))
def test_any_mig_member_reads_or_is_refused_by_name_never_crashes(member: object) -> None:
    text = json.dumps({"v": 1, "gen": 1, "used": [], "unhealthy": [], "mig": member})
    try:
        state = state_from_json(text)
    except TopologyFormatError as e:
        assert "mig" in str(e)
    else:
        assert member is None or state.mig is not None


def test_mig_peers_round_trip_and_need_an_island() -> None:
    gpu = MigGpuInfo("GPU-m", 0, 0, 3, None, (), ("GPU-0", "GPU-1"))
    state = NodeState(1, frozenset(), frozenset(), None, Mig("mixed", None, (gpu,)))
    assert state_from_json(state_to_json(state)) == state
    with pytest.raises(TopologyFormatError, match="lists 'peers' without an 'island'"):
        state_from_json(_migged({"island": None, "peers": ["GPU-0"]}))
    with pytest.raises(TopologyFormatError, match="'peers' must list at most 64 GPU ids"):
        state_from_json(_migged({"island": 1, "peers": [1]}))
