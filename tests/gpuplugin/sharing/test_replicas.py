"""Time-slicing and MPS replicas served over the real socket to the kubelet simulator: advertised ids, health and
NUMA of the parent, preferences on distinct best-connected GPUs, packing of single replicas, and refusals."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuplugin.deviceplugin.errors import AllocationRequestError
from gpuplugin.deviceplugin.lifecycle import PluginRunner
from gpuplugin.deviceplugin.plans import PlanSource
from gpuplugin.sharing.layout import SharedSet
from gpuplugin.sharing.manager import SharedResourceManager
from gpuplugin.sharing.mps import MpsGpu, MpsShare
from gputopo.contract import replica_id, replica_parent
from gputopo.core.allocator import allreduce_gbps, best_subset
from gputopo.core.topology import Topology
from gputopo.discovery.loader import load_topology_file
from sim.kubelet import AdmissionError, KubeletSimulator
from tests.gpuplugin.deviceplugin.conftest import DGX1, DGX_A100
from tests.helpers.paths import SHARED as SHARED_FIXTURES

SHARED = "nvidia.com/gpu.shared"
WAIT = 10.0
_DGX1 = load_topology_file(DGX1)
_MANAGERS: dict[str, SharedResourceManager] = {}


@pytest.fixture(scope="module")
def dgx1() -> Topology:
    return load_topology_file(DGX1)


@pytest.fixture(scope="module")
def a100() -> Topology:
    return load_topology_file(DGX_A100)


def _set(topo: Topology, replicas: int = 4, *, fail: bool = False, distinct: bool = True,
         strategy: str = "time-slicing", gpus: Sequence[int] | None = None) -> SharedSet:
    chosen = range(topo.size) if gpus is None else gpus
    return SharedSet(SHARED, strategy, fail, distinct, tuple((i, replicas) for i in chosen))


def _serve(kubelet: KubeletSimulator, plugin_dir: Path, manager: SharedResourceManager,
           registrations: int = 1) -> PluginRunner:
    runner = PluginRunner(manager, plugin_dir, SHARED, "gpu-shared.sock", backoff_initial=0.05,
                          backoff_max=0.5).start()
    kubelet.wait_for_registrations(SHARED, registrations, WAIT)
    return runner


def test_replicas_carry_the_parents_numa_and_health(kubelet: KubeletSimulator, plugin_dir: Path,
                                                    a100: Topology) -> None:
    manager = SharedResourceManager(a100, _set(a100, 3))
    runner = _serve(kubelet, plugin_dir, manager)
    try:
        devices = kubelet.wait_for_devices(SHARED, 24, WAIT)
        numa = {g.id: g.numa_node for g in a100.gpus}
        assert {d.id for d in devices} == {replica_id(g.id, n) for g in a100.gpus for n in range(3)}
        assert all(d.numa_nodes == (numa[replica_parent(d.id)[0]],) for d in devices)
        manager.set_health([a100.gpus[2].id], False)  # a health monitor names the GPU by UUID
        sick = kubelet.wait_until(SHARED, lambda ds: sum(not d.healthy for d in ds) == 3, WAIT)
        assert {replica_parent(d.id)[0] for d in sick if not d.healthy} == {a100.gpus[2].id}
        manager.set_health([a100.gpus[2].id], True)
        kubelet.wait_for_devices(SHARED, 24, WAIT)
    finally:
        runner.stop()


def test_k_replicas_are_k_distinct_gpus_the_best_ring(kubelet: KubeletSimulator, plugin_dir: Path,
                                                     dgx1: Topology) -> None:
    manager = SharedResourceManager(dgx1, _set(dgx1, 4))
    runner = _serve(kubelet, plugin_dir, manager)
    try:
        available = [d.id for d in kubelet.wait_for_devices(SHARED, 32, WAIT)]
        for k in (2, 4):
            answer = kubelet.preferred_raw(SHARED, available, [], k)
            parents = [dgx1.index_of(replica_parent(x)[0]) for x in answer]
            assert len(set(parents)) == k
            best = best_subset(dgx1, range(dgx1.size), k)
            assert sorted(parents) == sorted(best.gpus)
        # only two GPUs still have free replicas: no 3 replicas Allocate accepts exist. The answer is the part it
        # does accept, one replica of each GPU (answered: the kubelet must not fail admission here) ...
        few = [x for x in available if dgx1.index_of(replica_parent(x)[0]) in (0, 5)]
        answer = kubelet.preferred_raw(SHARED, few, [], 3)
        assert sorted(dgx1.index_of(replica_parent(x)[0]) for x in answer) == [0, 5]
        assert kubelet.allocate(SHARED, answer).envs["NVIDIA_VISIBLE_DEVICES"]
        with pytest.raises(AdmissionError, match="several replicas of GPU"):
            kubelet.allocate(SHARED, kubelet.preferred(SHARED, few, [], 3))  # ... the kubelet's fill-up is refused
    finally:
        runner.stop()


def test_one_replica_goes_where_sharing_costs_least(kubelet: KubeletSimulator, plugin_dir: Path,
                                                   dgx1: Topology) -> None:
    manager = SharedResourceManager(dgx1, _set(dgx1, 4))
    runner = _serve(kubelet, plugin_dir, manager)
    try:
        available = [d.id for d in kubelet.wait_for_devices(SHARED, 32, WAIT)]
        first = kubelet.preferred_raw(SHARED, available, [], 1)
        taken = set(first)
        for _ in range(3):  # the next ones pack onto the GPU already shared, up to its replicas
            nxt = kubelet.preferred_raw(SHARED, [x for x in available if x not in taken], [], 1)
            assert replica_parent(nxt[0])[0] == replica_parent(first[0])[0]
            taken |= set(nxt)
        fifth = kubelet.preferred_raw(SHARED, [x for x in available if x not in taken], [], 1)
        assert replica_parent(fifth[0])[0] != replica_parent(first[0])[0]  # never past the replicas
        # with one GPU shared elsewhere, that one is preferred over any fresh GPU
        elsewhere = replica_id(dgx1.gpus[6].id, 0)
        rest = [x for x in available if x != elsewhere]
        assert replica_parent(kubelet.preferred_raw(SHARED, rest, [], 1)[0])[0] == dgx1.gpus[6].id
    finally:
        runner.stop()


def test_allocate_gives_physical_gpus_once_and_refuses_what_the_config_forbids(
    kubelet: KubeletSimulator, plugin_dir: Path, dgx1: Topology
) -> None:
    g0, g1 = dgx1.gpus[0].id, dgx1.gpus[1].id
    runner = _serve(kubelet, plugin_dir, SharedResourceManager(dgx1, _set(dgx1, 2, distinct=False)))
    try:
        kubelet.wait_for_devices(SHARED, 16, WAIT)
        resp = kubelet.allocate(SHARED, [replica_id(g1, 1), replica_id(g0, 0), replica_id(g0, 1)])
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == f"{g0},{g1}"  # each GPU once, in index order
        assert "CUDA_MPS_PIPE_DIRECTORY" not in resp.envs
    finally:
        runner.stop()
    runner = _serve(kubelet, plugin_dir, SharedResourceManager(dgx1, _set(dgx1, 2, fail=True)), 2)
    try:
        kubelet.wait_until(SHARED, lambda ds: len(ds) == 16, WAIT)
        with pytest.raises(AdmissionError, match="maximum request size for shared resources is 1"):
            kubelet.allocate(SHARED, [replica_id(g0, 0), replica_id(g1, 0)])
        assert kubelet.allocate(SHARED, [replica_id(g1, 0)]).envs["NVIDIA_VISIBLE_DEVICES"] == g1
        with pytest.raises(AdmissionError, match="unknown device ids"):
            kubelet.allocate(SHARED, [replica_id(g1, 2)])
    finally:
        runner.stop()


class _Plans(PlanSource):
    def __init__(self, plan: list[str]) -> None:
        self.plan = plan
        self.asked: list[tuple[list[str], list[str], int]] = []

    def pending_plan(self, available_ids: Sequence[str], must_include_ids: Sequence[str],
                     size: int) -> list[str] | None:
        self.asked.append((list(available_ids), list(must_include_ids), size))
        return self.plan if len(self.plan) == size else None


def test_a_plan_of_parent_gpus_is_honoured_and_a_bad_one_ignored(dgx1: Topology) -> None:
    manager = SharedResourceManager(dgx1, _set(dgx1, 3))
    available = [d.id for d in manager.devices if d.id != replica_id(dgx1.gpus[6].id, 0)]
    plan = [dgx1.gpus[6].id, dgx1.gpus[2].id]
    plans = _Plans(plan)
    manager.set_plan_source(plans)
    pref = manager.preferred(available, [], 2)
    assert pref.source.value == "plan"
    assert pref.ids == (replica_id(dgx1.gpus[2].id, 0), replica_id(dgx1.gpus[6].id, 1))  # free replicas of those
    assert sorted(plans.asked[0][0]) == sorted(g.id for g in dgx1.gpus) and plans.asked[0][2] == 2
    plans.plan = [dgx1.gpus[6].id, dgx1.gpus[6].id]
    pref = manager.preferred(available, [], 2)
    assert pref.source.value == "allocator" and pref.reason.value == "plan_rejected"
    assert len({replica_parent(x)[0] for x in pref.ids}) == 2


def test_mps_replicas_wait_for_the_daemon_and_get_its_environment(
    kubelet: KubeletSimulator, plugin_dir: Path, dgx1: Topology, tmp_path: Path
) -> None:
    share = MpsShare(SHARED, tmp_path / "mps", tuple(MpsGpu(g.id, 4, 16384) for g in dgx1.gpus[:2]))
    manager = SharedResourceManager(dgx1, _set(dgx1, 4, strategy="mps", gpus=[0, 1]), mps=share)
    runner = _serve(kubelet, plugin_dir, manager)
    try:
        kubelet.wait_until(SHARED, lambda ds: len(ds) == 8 and not any(d.healthy for d in ds), WAIT)
        manager.set_service_health(True)
        kubelet.wait_for_devices(SHARED, 8, WAIT)
        resp = kubelet.allocate(SHARED, [replica_id(dgx1.gpus[1].id, 3)])
        pipe = str(tmp_path / "mps" / SHARED / "pipe")
        assert resp.envs["CUDA_MPS_PIPE_DIRECTORY"] == pipe
        assert resp.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
        assert resp.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=4096M"
        assert {(m.container_path, m.host_path) for m in resp.mounts} == {
            (pipe, pipe), ("/dev/shm", str(tmp_path / "mps" / "shm"))}
        manager.set_service_health(False)  # the daemon stopped answering
        kubelet.wait_until(SHARED, lambda ds: not any(d.healthy for d in ds), WAIT)
    finally:
        runner.stop()


def test_a_fresh_replica_breaks_an_island_already_broken_rather_than_a_whole_one() -> None:
    pairs = load_topology_file(
        SHARED_FIXTURES / "topologies" / "pcie-8x-a100-nv12-bridge-pairs-2socket-nccltests178.txt")
    assert pairs.nvlink_islands() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    manager = SharedResourceManager(pairs, _set(pairs, 2))
    # GPU 5 is fully taken (both replicas held): its island [4, 5] is no longer whole, so GPU 4 is the cheap one
    held = {replica_id(pairs.gpus[5].id, 0), replica_id(pairs.gpus[5].id, 1)}
    available = [d.id for d in manager.devices if d.id not in held]
    pref = manager.preferred(available, [], 1)
    assert [replica_parent(x)[0] for x in pref.ids] == [pairs.gpus[4].id]
    # nothing held: every island is whole; a 2-replica request still gets an NVLink pair (the best ring)
    pref = manager.preferred([d.id for d in manager.devices], [], 2)
    parents = sorted(pairs.index_of(replica_parent(x)[0]) for x in pref.ids)
    assert parents in ([0, 1], [2, 3], [4, 5], [6, 7])


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_k_replicas_are_always_distinct_and_as_good_as_exhaustive_search(data: st.DataObject) -> None:
    topo = _DGX1
    manager = _MANAGERS.setdefault("dgx1x3", SharedResourceManager(topo, _set(topo, 3)))
    free = data.draw(st.lists(st.sampled_from([d.id for d in manager.devices]), unique=True, min_size=1))
    parents = sorted({topo.index_of(replica_parent(x)[0]) for x in free})
    k = data.draw(st.integers(1, len(parents)))
    pref = manager.preferred(free, [], k)
    chosen = [topo.index_of(replica_parent(x)[0]) for x in pref.ids]
    assert len(chosen) == k == len(set(chosen)) and set(pref.ids) <= set(free)
    if k > 1:
        best = max(allreduce_gbps(topo, list(c)) for c in itertools.combinations(parents, k))
        assert allreduce_gbps(topo, chosen) == pytest.approx(best)


def _accepts(manager: SharedResourceManager, ids: Sequence[str]) -> bool:
    try:
        manager.allocate(list(ids))
    except AllocationRequestError:
        return False
    return True


def _fallbacks(manager: SharedResourceManager) -> float:
    value = manager.metrics.registry.get_sample_value("gpuplugin_preferred_fallbacks_total", {"reason": "bad_request"})
    return value or 0.0


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_preferred_answers_a_set_allocate_accepts_whenever_one_exists(data: st.DataObject) -> None:
    """Preference and Allocate agree over random configs and availability: when some set of the size asked that
    contains must_include is accepted by Allocate (found by exhaustive search), the answer is one; when none is,
    the answer is the part Allocate accepts, counted once as a bad request and logged once, never an error."""
    topo = _DGX1
    gpus = data.draw(st.lists(st.integers(0, topo.size - 1), unique=True, min_size=1, max_size=4), label="gpus")
    shared = _set(topo, data.draw(st.integers(2, 3), label="replicas"), fail=data.draw(st.booleans(), label="fail"),
                  distinct=data.draw(st.booleans(), label="distinct"), gpus=sorted(gpus))
    manager = SharedResourceManager(topo, shared)
    free = data.draw(st.lists(st.sampled_from([d.id for d in manager.devices]), unique=True, min_size=1),
                     label="available")
    must = data.draw(st.lists(st.sampled_from(free), unique=True, max_size=2), label="must")
    size = data.draw(st.integers(max(1, len(must)), len(free)), label="size")
    rest = [x for x in free if x not in must]
    exists = any(_accepts(manager, [*must, *more]) for more in itertools.combinations(rest, size - len(must)))
    with structlog.testing.capture_logs() as logs:
        pref = manager.preferred(free, must, size)
    assert set(must) <= set(pref.ids) <= set(free) and len(set(pref.ids)) == len(pref.ids)
    warned = [e for e in logs if e["event"] == "plugin.preferred.fallback"]
    if exists:
        assert len(pref.ids) == size and _accepts(manager, pref.ids), pref
        assert _fallbacks(manager) == 0 and warned == []
    else:
        assert len(pref.ids) < size or not _accepts(manager, must), pref
        if _accepts(manager, must) or not must:
            assert not pref.ids or _accepts(manager, pref.ids), pref  # the part Allocate accepts
        assert _fallbacks(manager) == 1 and len(warned) == 1, (pref, warned)


def test_an_unadmittable_request_asked_again_and_again_is_counted_each_time_and_logged_once_per_interval() -> None:
    now = [1000.0]
    manager = SharedResourceManager(_DGX1, _set(_DGX1, 2, gpus=[0, 1]), log_interval_s=10.0, clock=lambda: now[0])
    free = [d.id for d in manager.devices]
    with structlog.testing.capture_logs() as logs:
        answers = {manager.preferred(free, [], 3).ids for _ in range(50)}
        now[0] += 10.0
        manager.preferred(free, [], 3)
    assert len(answers) == 1 and _accepts(manager, answers.pop())
    warned = [e for e in logs if e["event"] == "plugin.preferred.fallback"]
    assert [e["not_logged_since_last"] for e in warned] == [0, 49]
    assert "no answer Allocate accepts" in str(warned[0]["problems"])
    assert _fallbacks(manager) == 51
