"""bench/mig.py on a short stream: every policy holds only free instances, never one twice, and the summary stays
in range (the figures themselves come from running the benchmark)."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from bench.mig import (
    ExtenderPolicy,
    Policy,
    build_fleet,
    core_policy,
    first_fit_policy,
    make_requests,
    random_fit_policy,
    simulate,
)


@pytest.mark.parametrize("make", [lambda: first_fit_policy, lambda: random_fit_policy, lambda: core_policy,
                                  ExtenderPolicy], ids=["first-fit", "random-fit", "core", "extender"])
def test_short_churn_keeps_the_fleet_consistent(make: Callable[[], Policy]) -> None:
    policy = make()
    nodes = build_fleet(4, random.Random(3))
    requests = make_requests(400, 4, 0.9, random.Random(4))
    core = policy is core_policy or isinstance(policy, ExtenderPolicy)
    out = simulate(requests, nodes, policy, core, 0.5, 5)  # asserts each hold's size
    assert 0 < out["served"] <= len(requests)
    assert out["waited_mig"] <= out["waited"]
    assert out["waited_with_room_mig"] <= out["waited_with_room"] <= len(requests)
    assert 0 <= out["idle_gpus_mean"] <= 32 and 1.0 <= out["multi_gpus"] <= 3.0
    # every instance is released at the end: nothing is held twice or leaked
    assert all(not s.used for n in nodes for g in n.gpus for s in (g.slots or ()))
    assert all(g.whole_by is None for n in nodes for g in n.gpus)
