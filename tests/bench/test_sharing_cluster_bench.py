"""bench/sharing_cluster.py's simulation on a short trace: every policy commits only what is possible (whole GPUs
idle, replicas within each GPU's count: the simulator asserts it), and ours never gives a multi-replica request two
replicas of one GPU (the figures themselves come from running the benchmark)."""

from __future__ import annotations

import pytest

from bench.sharing_cluster import POLICIES, SPLIT_KINDS, Gang, Ours, build, hami, nvidia, requests, simulate, summarise

SETUPS = {
    POLICIES[0]: (lambda k: True, lambda: nvidia(False)),
    POLICIES[1]: (lambda k: k in SPLIT_KINDS, lambda: nvidia(True)),
    POLICIES[2]: (lambda k: True, hami),
    POLICIES[3]: (lambda k: k in SPLIT_KINDS, lambda: Ours(True)),
    POLICIES[4]: (lambda k: False, lambda: Ours(False)),
}


@pytest.mark.parametrize("name", POLICIES)
def test_short_churn_commits_only_possible_placements(name: str) -> None:
    shared, make = SETUPS[name]
    reqs = requests(seed=5, hours=1.5, train_gpus=832)
    policy: Gang = make()
    out = simulate(policy, reqs, build(shared), seed=5, hours=1.5)
    s = summarise(out)
    assert sum(out.served.values()) > 0.9 * len(reqs)
    assert s.multi > 0 and s.islands_min >= 0 and s.train_jobs > 0
    if name == POLICIES[3]:
        assert s.repeats == 0
