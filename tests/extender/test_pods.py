"""How many GPUs a pod needs (the kubelet's rule) and how a plan is split among its containers."""

from __future__ import annotations

import pytest

from extender.state.pods import (
    APP,
    INIT,
    SIDECAR,
    ContainerNeed,
    PodSpecError,
    effective_count,
    parse_quantity,
    pod_needs,
    split_plan,
)
from gputopo.contract import Keys
from tests.extender.conftest import DGX1, topo
from tests.helpers.scheduler import pod_json

RES = "nvidia.com/gpu"
KEYS = (Keys(),)


@pytest.mark.parametrize(("containers", "expected"), [
    ([ContainerNeed("a", 2, APP), ContainerNeed("b", 3, APP)], 5),
    ([ContainerNeed("i", 6, INIT), ContainerNeed("a", 2, APP)], 6),
    ([ContainerNeed("i1", 2, INIT), ContainerNeed("i2", 1, INIT), ContainerNeed("a", 1, APP)], 2),
    ([ContainerNeed("s", 1, SIDECAR), ContainerNeed("i", 4, INIT), ContainerNeed("a", 2, APP)], 5),
    ([ContainerNeed("i", 4, INIT), ContainerNeed("s", 1, SIDECAR), ContainerNeed("a", 2, APP)], 4),
    ([], 0),
])
def test_effective_count_follows_the_kubelet(containers: list[ContainerNeed], expected: int) -> None:
    assert effective_count(containers) == expected


@pytest.mark.parametrize(("value", "expected"), [("2", 2), (3, 3), ("2000m", 2), ("1k", 1000), ("0", 0)])
def test_quantities(value: object, expected: int) -> None:
    assert parse_quantity(value, "x") == expected


@pytest.mark.parametrize("value", ["1.5", "500m", "-1", "two", "", True, None, [1]])
def test_bad_quantities_are_rejected_with_the_field(value: object) -> None:
    with pytest.raises(PodSpecError, match="limits"):
        parse_quantity(value, "containers[main] limits[nvidia.com/gpu]")


def test_limits_win_over_requests_and_missing_resources_count_zero() -> None:
    pod = pod_json(containers=[{"name": "a", "gpus": 2}, {"name": "cpu-only"}])
    pod["spec"]["containers"][0]["resources"] = {"requests": {RES: "1"}, "limits": {RES: "2"}}
    needs = pod_needs(pod, RES, *KEYS)
    assert needs.size == 2 and [c.name for c in needs.containers] == ["a"]


def test_split_gives_each_container_a_whole_nvlink_quad() -> None:
    t = topo(DGX1)
    parts = split_plan(t, list(range(8)), [ContainerNeed("a", 4, APP), ContainerNeed("b", 4, APP)])
    quads = sorted(sorted(p) for p in parts.values())
    assert quads == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_split_puts_the_init_container_inside_the_first_app_container() -> None:
    t = topo(DGX1)
    containers = [ContainerNeed("init", 2, INIT), ContainerNeed("a", 4, APP), ContainerNeed("b", 4, APP)]
    parts = split_plan(t, list(range(8)), containers)
    assert set(parts["init"]) <= set(parts["a"]) and not set(parts["a"]) & set(parts["b"])


def test_split_keeps_sidecars_apart_from_app_containers() -> None:
    t = topo(DGX1)
    containers = [ContainerNeed("side", 2, SIDECAR), ContainerNeed("i", 3, INIT), ContainerNeed("a", 3, APP)]
    chosen = list(range(5))
    assert effective_count(containers) == 5
    parts = split_plan(t, chosen, containers)
    assert not set(parts["side"]) & set(parts["a"])
    assert set(parts["i"]) <= set(parts["a"]) and len(parts["i"]) == 3
