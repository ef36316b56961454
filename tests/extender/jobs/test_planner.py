"""The job planner on cluster snapshots: the physical choices it must make, its reasons, bad input, and how its
plans compare with exhaustive search on small clusters."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extender.jobs.planner import (
    JobPlanError,
    JobRequest,
    JobUnplaceable,
    Member,
    NodeSnapshot,
    plan_job,
)
from gputopo.core import allreduce_gbps
from gputopo.core.bitset import bits, mask_of
from gputopo.core.jobs import Limit, PodSlot, job_allreduce_gbps
from gputopo.core.locality import Level, Locality
from gputopo.core.topology import Gpu, Link, LinkKind, Nic, Topology

K = LinkKind
LOC = Locality((Level("rack", ("example.com/rack",), 0.5), Level("zone", ("example.com/zone",), 0.5)))
ALL8 = (1 << 8) - 1


def hgx(gbit: float, nic_kinds: tuple[LinkKind, ...] = (K.PIX,) * 8) -> Topology:
    """8 NVSwitch GPUs; NIC k at `nic_kinds[k]` from GPU k and SYS from the others."""
    links = [[None if i == j else Link(K.NVSWITCH, 18, 4) for j in range(8)] for i in range(8)]
    nics = [Nic(f"mlx5_{k}", tuple(kind if i == k else K.SYS for i in range(8)), True, gbit)
            for k, kind in enumerate(nic_kinds)]
    return Topology.build([Gpu(i, f"G{i}") for i in range(8)], links, nics, pcie_generation=5)


def node(name: str, topo: Topology, rack: str, free: int = ALL8, zone: str = "z") -> NodeSnapshot:
    return NodeSnapshot(name, topo, free, (rack, zone))


def check(plan, nodes: list[NodeSnapshot]) -> None:
    """Every plan: the right number of slots, on free GPUs, disjoint, and the estimate the model gives."""
    by_name = {n.name: n for n in nodes}
    r = plan.request
    assert len(plan.slots) == (r.size - len(r.members) if r.size is not None else 1)
    taken: dict[str, int] = {}
    for s in plan.slots:
        assert len(s.gpus) == r.gpus_per_pod
        m = mask_of(s.gpus)
        assert m & by_name[s.node].free == m, "a slot on GPUs that are not free"
        assert not taken.get(s.node, 0) & m, "two slots share a GPU"
        taken[s.node] = taken.get(s.node, 0) | m
    pods = [PodSlot(m.node, by_name[m.node].topo, m.gpus, by_name[m.node].place) for m in r.members
            if m.node in by_name]
    pods += [PodSlot(s.node, by_name[s.node].topo, s.gpus, by_name[s.node].place) for s in plan.slots]
    assert plan.estimate == job_allreduce_gbps(pods, LOC)


def test_slow_nics_keep_a_small_job_on_one_node() -> None:
    """100 Gb/s NICs (12.5 GB/s) lose to the 25.8 GB/s host path: both workers on one node."""
    nodes = [node(f"n{i}", hgx(100.0), "r1") for i in range(4)]
    plan = plan_job(JobRequest("ml/mpi", 1, 2), nodes, LOC)
    check(plan, nodes)
    assert len(plan.counts) == 1 and plan.estimate.limit is Limit.HOST_PATH
    assert plan.where.startswith("node ")


def test_gpudirect_nics_spread_the_job_over_nodes_of_one_rack() -> None:
    """One 400 Gb/s GPUDirect NIC per GPU (DGX H100): 50 GB/s between nodes beats the host path (the issue)."""
    nodes = [node(f"a{i}", hgx(400.0), "r1") for i in range(3)] + [node(f"b{i}", hgx(400.0), "r2") for i in range(3)]
    plan = plan_job(JobRequest("ml/train-7", 4, 2), nodes, LOC)
    check(plan, nodes)
    assert len(plan.counts) == 2 and plan.estimate.gbps == pytest.approx(50.0)
    assert plan.estimate.split == -1 and plan.where in ("rack r1", "rack r2")


def test_pod_takes_the_gpu_whose_nic_shares_its_switch_when_the_job_spans_nodes() -> None:
    """Only GPU 5 has its NIC under its own switch (PIX); the others reach NICs across the socket."""
    kinds = tuple(K.PIX if k == 5 else K.SYS for k in range(8))
    nodes = [node(f"n{i}", hgx(400.0, kinds), "r1") for i in range(2)]
    plan = plan_job(JobRequest("ml/j", 1, 2), nodes, LOC)
    check(plan, nodes)
    if len(plan.counts) == 2:
        assert all(s.gpus == (5,) for s in plan.slots)
    # with only GPU 5 GPUDirect-capable, spreading gives 50 GB/s, above the host path
    assert plan.estimate.gbps == pytest.approx(50.0)


def test_members_keep_the_rest_of_the_job_in_their_rack_and_reasons_say_so() -> None:
    nodes = ([node(f"a{i}", hgx(400.0), "r12", free=ALL8 & ~1) for i in range(4)]
             + [node(f"b{i}", hgx(400.0), "r13") for i in range(8)])
    members = (Member("a0", (0,)), Member("a1", (0,)), Member("a2", (0,)))
    plan = plan_job(JobRequest("ml/train-7", 1, 4, members), nodes, LOC)
    check(plan, nodes)
    (slot,) = plan.slots
    assert slot.node.startswith("a") and plan.where == "rack r12"
    assert plan.reason_for(slot.node).startswith("job ml/train-7: 3 of 4 workers placed, 1 planned on this node; "
                                                 "it keeps the job on rack r12")
    assert "this node is not in the plan" in plan.reason_for("b0")


def test_least_fragmentation_between_equal_plans() -> None:
    """Equal estimates: the job takes the node left with exactly its GPUs rather than break a whole free node."""
    nodes = [node("whole", hgx(100.0), "r1"), node("half", hgx(100.0), "r1", free=0b11110000)]
    plan = plan_job(JobRequest("ml/j", 2, 2), nodes, LOC)
    check(plan, nodes)
    assert plan.counts == {"half": 2}


def test_unknown_size_plans_one_pod_near_the_members() -> None:
    nodes = [node("a0", hgx(100.0), "r1", free=ALL8 & ~0b11), node("b0", hgx(100.0), "r2")]
    plan = plan_job(JobRequest("ml/j", 2, None, (Member("a0", (0, 1)),)), nodes, LOC)
    check(plan, nodes)
    assert [s.node for s in plan.slots] == ["a0"]
    assert "placed, 1 planned" in plan.summary and "of ? workers" in plan.summary


def test_a_job_that_fits_nowhere_names_itself_and_the_shortfall() -> None:
    nodes = [node("a", hgx(100.0), "r1", free=0b1111), node("b", hgx(100.0), "r1", free=0b11)]
    with pytest.raises(JobUnplaceable, match=r"job ml/big: needs 4 more workers of 2 GPUs, the cluster has room for"
                                             r" 3 now") as e:
        plan_job(JobRequest("ml/big", 2, 4), nodes, LOC)
    assert e.value.reason.startswith("job ml/big")


def test_members_spread_over_zones_still_get_a_plan_at_the_cluster_level() -> None:
    nodes = [node("a", hgx(100.0), "r1", free=0b11111110, zone="z1"),
             node("b", hgx(100.0), "r2", free=0b11111110, zone="z2"), node("c", hgx(100.0), "r3", zone="z1")]
    plan = plan_job(JobRequest("ml/j", 1, 3, (Member("a", (0,)), Member("b", (0,)))), nodes, LOC)
    check(plan, nodes)
    assert plan.where == "the cluster"


def test_members_on_deleted_nodes_are_dropped_with_a_reason() -> None:
    nodes = [node("a", hgx(100.0), "r1")]
    plan = plan_job(JobRequest("ml/j", 1, 3, (Member("gone", (0,)),)), nodes, LOC)
    assert plan.dropped == ("worker on gone: node gone",)
    assert len(plan.slots) == 2 and "0 of 3 workers placed" in plan.summary


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (JobRequest("ml/j", 0, 2), "0 GPUs per pod is not a pod size"),
        (JobRequest("ml/j", True, 2), "True GPUs per pod"),
        (JobRequest("ml/j", 1, 0), "size 0 is not a number of pods"),
        (JobRequest("ml/j", 1, 1, (Member("a", (0,)),)), "all 1 worker placed; nothing to plan"),
        (JobRequest("ml/j", 2, 3, (Member("a", (0,)),)), "holds 1 GPU, the job's pods ask 2"),
        (JobRequest("ml/j", 2, 3, (Member("a", (0, 9)),)), "not distinct GPUs of a node with 8"),
        (JobRequest("ml/j", 2, 3, (Member("a", (1, 1)),)), "not distinct GPUs"),
    ],
)
def test_bad_requests_are_refused(request_, message) -> None:
    with pytest.raises(JobPlanError, match=message):
        plan_job(request_, [node("a", hgx(100.0), "r1")], LOC)


# -- against exhaustive search -----------------------------------------------------------------------------------


def _small_topology(rng: random.Random) -> Topology:
    n = rng.randint(2, 4)
    matrix: list[list[Link | None]] = [[None] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            link = Link(K.NVLINK, rng.randint(1, 4), 3) if rng.random() < 0.5 else Link(rng.choice(list(K)[2:]))
            matrix[i][j] = matrix[j][i] = link
    nics = [Nic(f"m{k}", tuple(rng.choice([K.PIX, K.PXB, K.PHB, K.SYS]) for _ in range(n)), True,
                rng.choice([100.0, 200.0, 400.0])) for k in range(rng.randint(0, 2))]
    return Topology.build([Gpu(i, f"G{i}") for i in range(n)], matrix, nics, pcie_generation=rng.choice([4, 5]))


def _cluster(seed: int) -> tuple[list[NodeSnapshot], JobRequest]:
    rng = random.Random(seed)
    nodes = []
    for i in range(rng.randint(1, 4)):
        topo = _small_topology(rng)
        free = rng.getrandbits(topo.size) | (1 if rng.random() < 0.3 else 0)
        nodes.append(NodeSnapshot(f"n{i}", topo, free, (rng.choice(["r1", "r2"]), rng.choice(["z1", "z1", "z2"]))))
    k = rng.randint(1, 2)
    return nodes, JobRequest("ml/j", k, rng.randint(1, 3))


def _exhaustive(nodes: list[NodeSnapshot], request: JobRequest) -> float | None:
    """The best estimate over every way to put the job's pods on free GPUs whose rings meet the job's floor (None
    when there is none)."""
    k = request.gpus_per_pod
    options = [(n, combo) for n in nodes for combo in itertools.combinations(bits(n.free), k)
               if allreduce_gbps(n.topo, combo) + 1e-9 >= _floor(n.topo, request)]
    best = None
    for chosen in itertools.combinations(options, request.size):
        used: dict[str, int] = {}
        if any(used.get(n.name, 0) & mask_of(c) or used.__setitem__(n.name, used.get(n.name, 0) | mask_of(c))
               for n, c in chosen):
            continue  # two pods on one GPU
        est = job_allreduce_gbps([PodSlot(n.name, n.topo, c, n.place) for n, c in chosen], LOC).gbps
        best = est if best is None else max(best, est)
    return best


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32))
def test_plans_are_valid_and_reach_the_best_estimate_exhaustive_search_finds(seed: int) -> None:
    nodes, request = _cluster(seed)
    optimum = _exhaustive(nodes, request)
    if optimum is None:
        with pytest.raises(JobUnplaceable):
            plan_job(request, nodes, LOC)
        return
    plan = plan_job(request, nodes, LOC)
    check(plan, nodes)
    assert plan.estimate.gbps == pytest.approx(optimum, rel=1e-9, abs=1e-9)


# -- a job's ring floors (require-nvlink, min-allreduce-gbps) -----------------------------------------------------


def _floor(topo: Topology, request: JobRequest) -> float:
    """The floor as the per-pod placement reads the annotations, computed apart from the planner's own."""
    if request.gpus_per_pod < 2:
        return 0.0
    floor = request.min_gbps
    if request.require_nvlink:
        nv = [topo.gbps(i, j) for i, j in itertools.combinations(range(topo.size), 2) if topo.link(i, j).kind.is_nvlink]
        floor = max(floor, min(nv)) if nv else float("inf")
    return floor


def _meets_floor(plan, nodes: list[NodeSnapshot]) -> bool:
    by_name = {n.name: n for n in nodes}
    return all(allreduce_gbps(by_name[s.node].topo, s.gpus) + 1e-9 >= _floor(by_name[s.node].topo, plan.request)
               for s in plan.slots)


def _constrained(seed: int) -> tuple[list[NodeSnapshot], JobRequest]:
    rng = random.Random(seed)
    nodes = []
    for i in range(rng.randint(1, 3)):
        topo = _small_topology(rng)
        free = (1 << topo.size) - 1 if rng.random() < 0.6 else rng.getrandbits(topo.size)
        nodes.append(NodeSnapshot(f"n{i}", topo, free, (rng.choice(["r1", "r2"]), "z1")))
    return nodes, JobRequest("ml/j", 2, rng.randint(1, 3), require_nvlink=rng.random() < 0.6,
                             min_gbps=rng.choice([0.0, 0.0, 10.0, 20.0, 40.0]))


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32))
def test_every_planned_pod_meets_the_jobs_floor_and_the_plan_is_the_best_that_does(seed: int) -> None:
    """Exact (small clusters) and candidate fills (as on a large cluster): every slot's ring meets the floor, and
    a plan exists exactly when some placement meets it; the exact plan is the best such placement."""
    nodes, request = _constrained(seed)
    optimum = _exhaustive(nodes, request)
    if optimum is None:
        for limit in (2_500, 0):
            with pytest.raises(JobUnplaceable, match=r"meet|room"):
                plan_job(request, nodes, LOC, exact_limit=limit)
        return
    plan = plan_job(request, nodes, LOC)
    check(plan, nodes)
    assert _meets_floor(plan, nodes)
    assert plan.estimate.gbps == pytest.approx(optimum, rel=1e-9, abs=1e-9)
    heuristic = plan_job(request, nodes, LOC, exact_limit=0)
    check(heuristic, nodes)
    assert _meets_floor(heuristic, nodes)


def _pairs_of_nvlink(split_friendly: bool) -> Topology:
    """4 GPUs. split_friendly: NVLink 1-2 (4 lanes), 0-1 and 2-3 (1 lane), PCIe elsewhere, so taking the fastest
    pair first strands 0 and 3 on PCIe while 0-1 + 2-3 gives two NVLink pods."""
    links: list[list[Link | None]] = [[None if i == j else Link(K.PXB) for j in range(4)] for i in range(4)]
    pairs = {(1, 2): 4, (0, 1): 1, (2, 3): 1} if split_friendly else {(0, 1): 2}
    for (i, j), lanes in pairs.items():
        links[i][j] = links[j][i] = Link(K.NVLINK, lanes, 4)
    return Topology.build([Gpu(i, f"G{i}") for i in range(4)], links, [], pcie_generation=4)


def test_require_nvlink_keeps_a_large_clusters_job_off_pcie_pairs() -> None:
    """Candidate fills (many ways): PCIe-only nodes and the PCIe pairs of NVLink nodes take no pod, and a node
    gives as many pods as disjoint NVLink pairs it has, not as its free count says."""
    pcie = _pairs_of_nvlink(False)
    pcie_only = Topology.build([Gpu(i, f"G{i}") for i in range(4)],
                               [[None if i == j else Link(K.SYS) for j in range(4)] for i in range(4)], [],
                               pcie_generation=4)
    split = _pairs_of_nvlink(True)
    nodes = [NodeSnapshot(f"pcie-{i:02d}", pcie_only, 0b1111, ("r1", "z")) for i in range(30)]
    nodes += [NodeSnapshot(f"pair-{i}", pcie, 0b1111, ("r1", "z")) for i in range(2)]
    nodes += [NodeSnapshot("split", split, 0b1111, ("r1", "z"))]
    request = JobRequest("ml/j", 2, 4, require_nvlink=True)
    for limit in (2_500, 0):
        plan = plan_job(request, nodes, LOC, exact_limit=limit)
        check(plan, nodes)
        assert _meets_floor(plan, nodes)
        assert sorted(s.node for s in plan.slots) == ["pair-0", "pair-1", "split", "split"]
        assert sorted(s.gpus for s in plan.slots if s.node == "split") == [(0, 1), (2, 3)]
    with pytest.raises(JobUnplaceable, match=r"needs 5 more workers of 2 GPUs whose rings meet require-nvlink, "
                                             r"the cluster has room for 4 now"):
        plan_job(JobRequest("ml/j", 2, 5, require_nvlink=True), nodes, LOC, exact_limit=0)


def test_min_allreduce_gbps_is_a_floor_for_every_pod_of_the_job() -> None:
    fast = hgx(400)
    nodes = [node(f"n{i}", fast, "r1", free=0b0000_0011) for i in range(3)]
    ring = allreduce_gbps(fast, (0, 1))
    plan = plan_job(JobRequest("ml/j", 2, 3, min_gbps=ring), nodes, LOC, exact_limit=0)
    check(plan, nodes)
    with pytest.raises(JobUnplaceable, match="min-allreduce"):
        plan_job(JobRequest("ml/j", 2, 3, min_gbps=ring * 2), nodes, LOC, exact_limit=0)
    with pytest.raises(JobPlanError, match="not a floor"):
        plan_job(JobRequest("ml/j", 2, 3, min_gbps=-1.0), nodes, LOC)
