"""bench/jobs.py's simulation on a short trace: every policy places every job on free GPUs it owns, all pods at
once, and the summary stays in range (the figures themselves come from running the benchmark)."""

from __future__ import annotations

import pytest

from bench.jobs import POLICIES, JobAware, RackLevel, blind_pod, build_cluster, per_pod, simulate, summarise, trace
from bench.placement import ExtenderPolicy


@pytest.mark.parametrize("name", POLICIES)
def test_short_churn_places_whole_jobs_on_free_gpus(name: str) -> None:
    nodes, places = build_cluster()
    jobs = trace(seed=3, hours=1.0, gpus=sum(n.topo.size for n in nodes), load=0.9)
    policy = {POLICIES[0]: lambda: per_pod(blind_pod), POLICIES[1]: lambda: per_pod(ExtenderPolicy()),
              POLICIES[2]: lambda: RackLevel(places), POLICIES[3]: lambda: JobAware(places)}[name]()
    out = simulate(policy, jobs, seed=3)  # asserts each placement: pod count, GPUs per pod, GPUs free
    assert len(out.placed) == len(jobs)
    s = summarise(out)
    assert s.multi > 0 and s.mean_gbps > 0 and 0 <= s.p10_gbps <= s.mean_gbps
    assert 0 <= s.node_share <= s.rack_share <= 1 and 0 < s.utilisation <= 1
