"""The job bandwidth model: exact against exhaustive search over rings, and the physical facts it encodes."""

from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gputopo.core import allreduce_gbps, bandwidth
from gputopo.core.jobs import JobModelError, Limit, PodSlot, job_allreduce_gbps
from gputopo.core.locality import Level, Locality
from gputopo.core.topology import Gpu, Link, LinkKind, Nic, Topology
from gputopo.discovery.loader import load_topology_file
from tests.helpers.paths import SHARED

PCIE = [LinkKind.PIX, LinkKind.PXB, LinkKind.PHB, LinkKind.NODE, LinkKind.SYS]


def _node_topology(rng: random.Random, n: int) -> Topology:
    """A small machine with NVLink pairs or PCIe, and 0-3 NICs of random kind, rate and RDMA capability."""
    matrix: list[list[Link | None]] = [[None] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            link = Link(LinkKind.NVLINK, rng.randint(1, 4), 3) if rng.random() < 0.4 else Link(rng.choice(PCIE))
            matrix[i][j] = matrix[j][i] = link
    nics = [
        Nic(f"mlx5_{k}", tuple(rng.choice(PCIE) for _ in range(n)), rng.choice([True, False, None]),
            rng.choice([None, 100.0, 200.0, 400.0]))
        for k in range(rng.randint(0, 3))
    ]
    return Topology.build([Gpu(i, f"G{i}") for i in range(n)], matrix, nics, pcie_generation=rng.choice([3, 4, 5]))


def _locality(rng: random.Random) -> Locality:
    levels = [Level(name, (f"example.com/{name}",), rng.choice([0.25, 0.5, 0.8, 1.0]))
              for name in ("rack", "spine", "zone")[: rng.randint(1, 3)]]
    return Locality(tuple(levels))


def _job(seed: int, max_nodes: int = 5) -> tuple[list[PodSlot], Locality]:
    rng = random.Random(seed)
    loc = _locality(rng)
    pods: list[PodSlot] = []
    for k in range(rng.randint(1, max_nodes)):
        topo = _node_topology(rng, rng.randint(2, 6))
        place = tuple(rng.choice(["a", "b", None]) for _ in loc.levels)
        free = list(range(topo.size))
        rng.shuffle(free)
        for _ in range(rng.randint(1, 3)):
            if not free:
                break
            size = rng.randint(1, min(3, len(free)))
            gpus, free = tuple(sorted(free[:size])), free[size:]
            pods.append(PodSlot(f"node-{k}", topo, gpus, place))
    return pods, loc


def _exhaustive(pods: list[PodSlot], loc: Locality) -> float:
    """Best over every domain-contiguous node order and every choice of entry and exit pod per node of the ring's
    slowest edge."""
    if sum(len(p.gpus) for p in pods) <= 1:
        return 0.0
    best = math.inf
    for p in pods:
        if len(p.gpus) >= 2:
            best = min(best, allreduce_gbps(p.topo, p.gpus))
    nodes: dict[str, list[PodSlot]] = {}
    for p in pods:
        nodes.setdefault(p.node, []).append(p)
    if any(len(v) >= 2 for v in nodes.values()):
        best = min(best, bandwidth.HOST_PATH_GBPS)
    names = list(nodes)
    if len(names) == 1:
        return best

    def ends(members: list[PodSlot]) -> list[tuple[float, float]]:
        rates = [p.network_gbps for p in members]
        if len(rates) == 1:
            return [(rates[0], rates[0])]
        return [(a, b) for a, b in itertools.permutations(rates, 2)]

    choices = [ends(nodes[name]) for name in names]
    places = [nodes[name][0].place for name in names]
    net = 0.0
    for order in itertools.permutations(range(1, len(names))):
        ring = (0, *order)
        if not _domains_contiguous([places[k] for k in ring]):
            continue
        for pick in itertools.product(*choices):
            slowest = math.inf
            for a, b in zip(ring, ring[1:] + ring[:1], strict=True):
                out_rate, in_rate = pick[a][1], pick[b][0]
                edge = min(out_rate, in_rate) * loc.factor(loc.split(places[a], places[b]))
                slowest = min(slowest, edge)
            net = max(net, slowest)
    return min(best, net)


def _domains_contiguous(cycle: list[tuple]) -> bool:
    """Every locality domain (a level's value with all outer levels) occupies one arc of the cyclic order."""
    n = len(cycle)
    for level in range(len(cycle[0])):
        keys = [place[level:] for place in cycle]
        for key in set(keys):
            entries = sum(1 for k in range(n) if keys[k] == key and keys[k - 1] != key)
            if entries > 1:
                return False
    return True


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2**32))
def test_estimate_equals_exhaustive_search_over_rings(seed: int) -> None:
    pods, loc = _job(seed)
    assert job_allreduce_gbps(pods, loc).gbps == pytest.approx(_exhaustive(pods, loc), rel=1e-9, abs=1e-9)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32))
def test_more_oversubscription_never_raises_the_estimate(seed: int) -> None:
    pods, loc = _job(seed)
    harsher = Locality(tuple(Level(lv.name, lv.keys, lv.factor / 2) for lv in loc.levels))
    assert job_allreduce_gbps(pods, harsher).gbps <= job_allreduce_gbps(pods, loc).gbps + 1e-9


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32))
def test_estimate_is_bounded_by_each_pod_ring_and_the_host_path(seed: int) -> None:
    pods, loc = _job(seed)
    est = job_allreduce_gbps(pods, loc)
    for p in pods:
        if len(p.gpus) >= 2:
            assert est.gbps <= allreduce_gbps(p.topo, p.gpus) + 1e-9
    if len({p.node for p in pods}) < len(pods):
        assert est.gbps <= bandwidth.HOST_PATH_GBPS + 1e-9


FLAT = Locality((Level("rack", ("example.com/rack",), 0.5), Level("zone", ("example.com/zone",), 0.5)))


def _h100_like(nic_kind: LinkKind, gbit: float, rdma: bool = True) -> Topology:
    """8 NVSwitch GPUs, one NIC per GPU at `nic_kind` (SYS to the others): a DGX H100 when PIX and 400 Gb/s."""
    n = 8
    links = [[None if i == j else Link(LinkKind.NVSWITCH, 18, 4) for j in range(n)] for i in range(n)]
    nics = [Nic(f"mlx5_{k}", tuple(nic_kind if i == k else LinkKind.SYS for i in range(n)), rdma, gbit)
            for k in range(n)]
    return Topology.build([Gpu(i, f"G{i}") for i in range(n)], links, nics, pcie_generation=5)


def test_dgx_h100_spreading_beats_one_node_the_issue_example() -> None:
    """One 400 Gb/s GPUDirect NIC per GPU: 50 GB/s between nodes, more than the 25.8 GB/s host path on one node."""
    topo = _h100_like(LinkKind.PIX, 400.0)
    one_node = [PodSlot("a", topo, (0, 1, 2, 3), ("r1", "z")), PodSlot("a", topo, (4, 5, 6, 7), ("r1", "z"))]
    two_nodes = [PodSlot("a", topo, (0, 1, 2, 3), ("r1", "z")), PodSlot("b", topo, (0, 1, 2, 3), ("r1", "z"))]
    assert job_allreduce_gbps(one_node, FLAT).gbps == pytest.approx(25.8)
    assert job_allreduce_gbps(one_node, FLAT).limit is Limit.HOST_PATH
    est = job_allreduce_gbps(two_nodes, FLAT)
    assert (est.gbps, est.limit, est.nodes, est.split) == (pytest.approx(50.0), Limit.NETWORK, 2, -1)


def test_nic_across_the_socket_is_staged_through_host_memory() -> None:
    """Same rate, NIC behind the CPU (SYS): no GPUDirect RDMA, the staged path caps it below the line rate."""
    far = _h100_like(LinkKind.SYS, 400.0)
    staged = bandwidth.gpu_nic_gbps("SYS", True, 400.0, 5, far.socket_link_gbps)
    assert staged < 50.0
    pods = [PodSlot("a", far, (0,), ("r1", "z")), PodSlot("b", far, (0,), ("r1", "z"))]
    assert job_allreduce_gbps(pods, FLAT).gbps == pytest.approx(staged)
    plain = _h100_like(LinkKind.PIX, 400.0, rdma=False)  # a plain Ethernet NIC on the switch: no GPUDirect either
    pods = [PodSlot("a", plain, (0,), ("r1", "z")), PodSlot("b", plain, (0,), ("r1", "z"))]
    assert job_allreduce_gbps(pods, FLAT).gbps < 50.0


def test_each_level_crossed_costs_its_factor() -> None:
    topo = _h100_like(LinkKind.PIX, 400.0)
    same_rack = [PodSlot("a", topo, (0,), ("r1", "z1")), PodSlot("b", topo, (0,), ("r1", "z1"))]
    racks = [PodSlot("a", topo, (0,), ("r1", "z1")), PodSlot("b", topo, (0,), ("r2", "z1"))]
    zones = [PodSlot("a", topo, (0,), ("r1", "z1")), PodSlot("b", topo, (0,), ("r1", "z2"))]
    assert [job_allreduce_gbps(p, FLAT).gbps for p in (same_rack, racks, zones)] == pytest.approx([50, 25, 12.5])
    assert [job_allreduce_gbps(p, FLAT).split for p in (same_rack, racks, zones)] == [-1, 0, 1]


def test_ring_keeps_racks_together_and_crosses_them_on_the_fastest_nics() -> None:
    """2 racks: the ring crosses between them twice, each crossing needing a 400 Gb/s node at both of its ends."""
    fast, slow = _h100_like(LinkKind.PIX, 400.0), _h100_like(LinkKind.PIX, 200.0)

    def job(kinds: str) -> list[PodSlot]:
        return [PodSlot(f"{rack}{k}", fast if kind == "F" else slow, (0,), (rack, "z"))
                for rack in ("r1", "r2") for k, kind in enumerate(kinds)]

    # two fast nodes per rack: both crossings 50 x 0.5 = 25, inside the racks slow NICs 25
    assert job_allreduce_gbps(job("FFS"), FLAT).gbps == pytest.approx(25.0)
    # one fast node per rack: the second crossing has a 200 Gb/s end, 25 x 0.5
    assert job_allreduce_gbps(job("FSS"), FLAT).gbps == pytest.approx(12.5)


def test_single_gpu_and_single_pod_jobs() -> None:
    topo = _h100_like(LinkKind.PIX, 400.0)
    assert job_allreduce_gbps([PodSlot("a", topo, (3,), ("r", "z"))], FLAT).limit is Limit.NONE
    est = job_allreduce_gbps([PodSlot("a", topo, (0, 1, 2, 3), ("r", "z"))], FLAT)
    assert (est.gbps, est.limit) == (pytest.approx(allreduce_gbps(topo, (0, 1, 2, 3))), Limit.POD_RING)


@pytest.mark.parametrize(
    ("pods", "message"),
    [
        ([], "at least one pod"),
        ([("a", (0, 0))], "not distinct"),
        ([("a", (9,))], "not distinct"),
        ([("a", (0, 1)), ("a", (1, 2))], "share GPU 1"),
        ([("a", ())], "no GPUs"),
    ],
)
def test_inconsistent_jobs_are_refused(pods, message) -> None:
    topo = _h100_like(LinkKind.PIX, 400.0)
    with pytest.raises(JobModelError, match=message):
        job_allreduce_gbps([PodSlot(n, topo, g, ("r", "z")) for n, g in pods], FLAT)


def test_one_node_described_two_ways_is_refused() -> None:
    topo = _h100_like(LinkKind.PIX, 400.0)
    with pytest.raises(JobModelError, match="described two ways"):
        job_allreduce_gbps([PodSlot("a", topo, (0,), ("r1", "z")), PodSlot("a", topo, (1,), ("r2", "z"))], FLAT)


def _with_rate(topo: Topology, gbit: float) -> Topology:
    nics = [Nic(n.name, n.gpu_links, n.rdma, gbit) for n in topo.nics]
    return Topology.build(topo.gpus, topo.links, nics, topo.pcie_generation, topo.socket_link_gbps)


def test_fixture_nics_give_gpudirect_only_where_the_nic_shares_the_switch() -> None:
    """At 200 Gb/s (HDR): the DGX A100's compute NICs are PXB to every GPU (25 GB/s each), while the RTX 5090
    server's two NICs sit behind the host bridge (NODE) or the other socket (SYS): staged, below the line rate."""
    a100 = _with_rate(load_topology_file(SHARED / "topologies" / "dgx-a100-8gpu-10nic-1mcprddgx05.txt"), 200.0)
    assert a100.network_gbps == pytest.approx((25.0,) * 8)
    rtx = _with_rate(load_topology_file(SHARED / "topologies" / "pcie-8x-rtx5090-2socket-sglang23020.txt"), 200.0)
    assert max(rtx.network_gbps) < 25.0
    assert rtx.network_gbps[0] > rtx.network_gbps[7]  # GPU0 is on the NICs' socket (NODE), GPU7 across it (SYS)
