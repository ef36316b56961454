"""GetPreferredAllocation: the core allocator's answer, plans from a PlanSource when they fit, and a valid answer
(never an RPC error) for any bad request."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import grpc
import pytest

from gpuplugin.deviceplugin.plans import PlanSource
from gpuplugin.deviceplugin.resource import ResourceManager
from gpuplugin.proto import deviceplugin_pb2 as pb
from gpuplugin.proto import deviceplugin_pb2_grpc as pb_grpc
from gputopo.core.allocator import best_subset
from gputopo.core.topology import Topology
from sim.kubelet import KubeletSimulator
from tests.gpuplugin.deviceplugin.conftest import RESOURCE, RunnerFactory, sample

WAIT = 10.0


def _expected(topo: Topology, available: Sequence[str], must: Sequence[str], size: int) -> list[str]:
    choice = best_subset(topo, topo.indices_of(available), size, topo.indices_of(must))
    return [topo.ids[i] for i in choice.gpus]


@pytest.fixture
def dgx1_plugin(kubelet: KubeletSimulator, start_plugin: RunnerFactory, dgx1: Topology) -> ResourceManager:
    manager = ResourceManager(dgx1)
    start_plugin(manager)
    kubelet.wait_for_devices(RESOURCE, 8, WAIT)
    return manager


@pytest.mark.parametrize("size", range(1, 9))
def test_every_size_on_dgx1_equals_best_subset(
    kubelet: KubeletSimulator, dgx1_plugin: ResourceManager, dgx1: Topology, size: int
) -> None:
    ids = list(dgx1.ids)
    answer = kubelet.preferred_raw(RESOURCE, ids, [], size)
    assert answer == _expected(dgx1, ids, [], size)
    assert kubelet.preferred(RESOURCE, ids, [], size) == answer


def test_partial_free_sets_and_must_include_equal_best_subset(
    kubelet: KubeletSimulator, dgx1_plugin: ResourceManager, dgx1: Topology
) -> None:
    rng = random.Random(7)
    for _ in range(40):
        available = rng.sample(list(dgx1.ids), rng.randint(2, 8))  # the kubelet's order is arbitrary
        size = rng.randint(1, len(available))
        must = rng.sample(available, rng.randint(0, min(2, size)))
        answer = kubelet.preferred_raw(RESOURCE, available, must, size)
        assert answer == _expected(dgx1, available, must, size), (available, must, size)
        assert set(must) <= set(answer)


def test_dgx1_four_gpus_stay_in_one_nvlink_quad(
    kubelet: KubeletSimulator, dgx1_plugin: ResourceManager, dgx1: Topology
) -> None:
    """Behaviour, not just agreement: on the hybrid cube-mesh, 4 GPUs come from one fully connected quad."""
    answer = kubelet.preferred_raw(RESOURCE, list(dgx1.ids), [], 4)
    idx = dgx1.indices_of(answer)
    assert all(dgx1.link(a, b).kind.is_nvlink for a in idx for b in idx if a != b)


BAD_REQUESTS = [
    pytest.param(["GPU0", "GPU1", "nope"], [], 2, "unknown id", id="unknown-id"),
    pytest.param(["GPU0", "GPU1"], [], 0, "size 0", id="size-zero"),
    pytest.param(["GPU0", "GPU1"], [], -3, "negative size", id="size-negative"),
    pytest.param(["GPU0", "GPU1", "GPU2"], [], 5, "size above available", id="size-too-big"),
    pytest.param(["GPU0", "GPU0", "GPU1", "GPU2"], [], 2, "duplicate", id="duplicates"),
    pytest.param(["GPU0", "GPU1", "GPU2"], ["GPU7"], 2, "must outside available", id="must-outside"),
    pytest.param(["GPU0", "GPU1", "GPU2"], ["GPU0", "GPU1", "GPU2"], 2, "must above size", id="must-too-many"),
    pytest.param([], [], 1, "nothing available", id="empty"),
    pytest.param(["x" * 200], ["y"], 2**31 - 1, "garbage", id="garbage"),
]


@pytest.mark.parametrize(("available", "must", "size", "why"), BAD_REQUESTS)
def test_bad_requests_get_valid_fallback_not_rpc_error(
    kubelet: KubeletSimulator,
    dgx1_plugin: ResourceManager,
    dgx1: Topology,
    available: list[str],
    must: list[str],
    size: int,
    why: str,
) -> None:
    answer = kubelet.preferred_raw(RESOURCE, available, must, size)  # raises AdmissionError on an RPC error
    valid = set(available) & set(dgx1.ids)
    assert set(answer) <= valid
    assert len(answer) == len(set(answer))
    assert len(answer) <= max(size, 0)
    assert sample(dgx1_plugin, "gpuplugin_preferred_fallbacks_total", reason="bad_request") == 1


def test_size_above_available_answers_all_valid_available(
    kubelet: KubeletSimulator, dgx1_plugin: ResourceManager
) -> None:
    assert kubelet.preferred_raw(RESOURCE, ["GPU5", "GPU2", "bad"], [], 4) == ["GPU2", "GPU5"]


def test_duplicates_still_get_the_allocator_answer(
    kubelet: KubeletSimulator, dgx1_plugin: ResourceManager, dgx1: Topology
) -> None:
    answer = kubelet.preferred_raw(RESOURCE, [*dgx1.ids, "GPU3"], [], 4)
    assert answer == _expected(dgx1, list(dgx1.ids), [], 4)


def test_one_response_per_container_request(dgx1_plugin: ResourceManager, plugin_dir: Path, dgx1: Topology) -> None:
    req = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=list(dgx1.ids), allocation_size=2),
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=["bad"], allocation_size=1),
            pb.ContainerPreferredAllocationRequest(available_deviceIDs=list(dgx1.ids), allocation_size=8),
        ]
    )
    with grpc.insecure_channel(f"unix:{plugin_dir / 'gpu-topology.sock'}") as channel:
        resp = pb_grpc.DevicePluginStub(channel).GetPreferredAllocation(req, timeout=5)
    assert [len(r.deviceIDs) for r in resp.container_responses] == [2, 0, 8]
    assert sample(dgx1_plugin, "gpuplugin_preferred_allocation_seconds_count") == 1


class _Plans(PlanSource):
    def __init__(self, plan: object = None, error: Exception | None = None) -> None:
        self.plan = plan
        self.error = error
        self.calls: list[tuple[list[str], list[str], int]] = []

    def pending_plan(
        self, available_ids: Sequence[str], must_include_ids: Sequence[str], size: int
    ) -> list[str] | None:
        self.calls.append((list(available_ids), list(must_include_ids), size))
        if self.error is not None:
            raise self.error
        return self.plan  # type: ignore[return-value]


def test_fitting_plan_is_used(kubelet: KubeletSimulator, dgx1_plugin: ResourceManager, dgx1: Topology) -> None:
    plans = _Plans(plan=["GPU6", "GPU4"])  # a valid 2-GPU plan that differs from the allocator's own choice
    assert _expected(dgx1, list(dgx1.ids), [], 2) != ["GPU4", "GPU6"]
    dgx1_plugin.set_plan_source(plans)
    assert kubelet.preferred_raw(RESOURCE, list(dgx1.ids), [], 2) == ["GPU4", "GPU6"]
    assert plans.calls == [(list(dgx1.ids), [], 2)]
    assert sample(dgx1_plugin, "gpuplugin_preferred_plan_hits_total") == 1


@pytest.mark.parametrize(
    ("plan", "error", "reason"),
    [
        pytest.param(["GPU0", "GPU1", "GPU2"], None, "plan_rejected", id="wrong-size"),
        pytest.param(["GPU0", "GPU7"], None, "plan_rejected", id="not-available"),
        pytest.param(["GPU2", "GPU3"], None, "plan_rejected", id="lacks-must"),
        pytest.param(["GPU1", "GPU1"], None, "plan_rejected", id="repeats"),
        pytest.param("GPU0,GPU1", None, "plan_rejected", id="not-a-list"),
        pytest.param(None, RuntimeError("cache broken"), "plan_error", id="raises"),
        pytest.param(None, None, "no_plan", id="no-plan"),
    ],
)
def test_unfit_plan_falls_back_to_allocator(
    kubelet: KubeletSimulator,
    dgx1_plugin: ResourceManager,
    dgx1: Topology,
    plan: object,
    error: Exception | None,
    reason: str,
) -> None:
    dgx1_plugin.set_plan_source(_Plans(plan=plan, error=error))
    available = ["GPU0", "GPU1", "GPU2", "GPU3", "GPU4", "GPU5", "GPU6"]
    answer = kubelet.preferred_raw(RESOURCE, available, ["GPU1"], 2)
    assert answer == _expected(dgx1, available, ["GPU1"], 2)
    assert sample(dgx1_plugin, "gpuplugin_preferred_fallbacks_total", reason=reason) == 1
    assert sample(dgx1_plugin, "gpuplugin_preferred_plan_hits_total") == 0
