"""bench/scale.py's pure parts: the backlog that fits, the placements of pre-bound pods, the profile's buckets, the
tables; and the /proc and body-size readings it takes through bench/real_scheduler.py (the figures themselves come
from running the benchmark)."""

from __future__ import annotations

import pytest

from bench.real_scheduler import DEFAULT, EXTENDER, RunResult, cycle_figures, stat_cpu_seconds, vm_rss_mib
from bench.scale import (
    IDLE,
    OTHER,
    SizeResult,
    StartResult,
    backlog_pods,
    bound_placements,
    profile_buckets,
    profile_table,
    shares,
    size_table,
    start_table,
)

PROCESS = 'process 4242:"/work/main/.venv/bin/python -m extender.cli serve --port 1"'


def test_the_backlog_is_capped_to_two_thirds_of_the_gpus() -> None:
    assert backlog_pods(1000, 38000) == 1000
    assert backlog_pods(1000, 1808) == 502  # 1808 * 2/3 / 2.4 GPUs per pod
    assert backlog_pods(1000, 1) == 1


def test_bound_placements_go_round_robin_and_grow_by_adding() -> None:
    ids = {"a": ["0", "1", "2"], "b": ["0"], "c": ["0", "1"]}
    assert bound_placements(ids, 6) == [("a", "0"), ("b", "0"), ("c", "0"), ("a", "1"), ("c", "1"), ("a", "2")]
    assert bound_placements(ids, 6)[:4] == bound_placements(ids, 4)
    assert len(set(bound_placements(ids, 6))) == 6  # no GPU in two plans
    with pytest.raises(ValueError):
        bound_placements(ids, 7)


def test_profile_buckets_sort_stacks_by_their_first_matching_bucket_and_leave_waits_out() -> None:
    raw = "\n".join([
        f"{PROCESS};answer (extender/http/answers.py:130);filter (extender/verbs.py:64);"
        "extender_args (extender/wire.py:188) 7",  # parsing inside a verb is parsing
        f"{PROCESS};answer (extender/http/answers.py:130);filter (extender/verbs.py:80);"
        "Ranker.rank (extender/placement/policy.py:345) 5",
        f"{PROCESS};Thread.run (threading.py:982);Watcher.loop (gputopo/kube/watching.py:283);"
        "Worker.pause (gputopo/workers.py:179);Condition.wait (threading.py:331) 900",  # parked: idle
        f"{PROCESS};Thread.run (threading.py:982);Watcher._watch_once (gputopo/kube/watching.py:386) 3",
        f"{PROCESS};Runner.run (asyncio/runners.py:118) 400",  # uvloop waiting in C
        f"{PROCESS};Runner.run (asyncio/runners.py:118);HeadWithBody.write (extender/http/server.py:198) 2",
        f"{PROCESS};mystery (somewhere.py:1) 1",
        "not a sample line",
    ])
    buckets = profile_buckets(raw)
    assert buckets == {"JSON parse/encode (wire, orjson)": 7, "filter placement": 5, IDLE: 1300,
                       "watch events, state": 3, "HTTP server, event loop": 2, OTHER: 1}
    pct = shares(buckets)
    assert IDLE not in pct
    assert next(iter(pct)) == "JSON parse/encode (wire, orjson)"
    assert sum(pct.values()) == pytest.approx(100, abs=0.2)
    assert shares({IDLE: 5}) == {}


def test_proc_readings() -> None:
    assert vm_rss_mib("Name:\tpython\nVmPeak:\t 300000 kB\nVmRSS:\t  122880 kB\nThreads:\t9\n") == 120.0
    assert vm_rss_mib("Name:\tzombie\nState:\tZ (zombie)\n") is None
    stat = "4242 (python -m (odd)) S 1 4242 4242 0 -1 4194304 100 0 0 0 250 50 0 0 20 0 9 0 1000 0 0"
    assert stat_cpu_seconds(stat, 100) == (1, 3.0)


def test_cycle_figures_read_the_body_sizes_per_verb() -> None:
    metrics = "\n".join([
        'gpu_extender_request_seconds_sum{verb="filter"} 0.02', 'gpu_extender_request_seconds_count{verb="filter"} 4',
        'gpu_extender_request_body_bytes_sum{verb="filter"} 16000.0',
        'gpu_extender_request_body_bytes_count{verb="filter"} 4.0',
        'gpu_extender_response_body_bytes_sum{verb="filter"} 9000.0',
        'gpu_extender_response_body_bytes_count{verb="filter"} 4.0',
        'gpu_extender_request_body_bytes_sum{verb="bind"} 0.0',
        'gpu_extender_request_body_bytes_count{verb="bind"} 0.0'])
    r = RunResult(1, 1, EXTENDER, "extender-1", 4, (1.0, 1.0, 1.0))
    cycle_figures(r, "", metrics)
    assert r.extender_bytes == {"filter_request": 4000.0, "filter_response": 2250.0}


def _run(run: int, pair: int, path: str, rate: float, cpu: dict[str, float]) -> RunResult:
    r = RunResult(run, pair, path, f"{path}-{pair}", 500, (1.0, 1.0, 1.0), bound=500, pods_per_s=rate,
                  algorithm_ms=10.0 if path == EXTENDER else 2.0, cpu_ms_per_pod=cpu)
    if path == EXTENDER:
        r.extender_bytes = {"filter_request": 4000.0 + run, "filter_response": 2000.0}
        r.extender_rss_mib = 120.0 + run
    return r


def test_tables() -> None:
    runs = [_run(1, 1, EXTENDER, 60.0, {"extender": 4.0, "kube-scheduler": 5.0, "kube-apiserver": 4.0, "etcd": 1.0}),
            _run(2, 1, DEFAULT, 120.0, {"kube-scheduler": 3.0, "kube-apiserver": 3.0, "etcd": 0.5}),
            _run(3, 2, EXTENDER, 50.0, {"extender": 6.0, "kube-scheduler": 7.0, "kube-apiserver": 4.0, "etcd": 1.0}),
            _run(4, 2, DEFAULT, 125.0, {"kube-scheduler": 3.0, "kube-apiserver": 3.0, "etcd": 0.5})]
    size = SizeResult(250, 1808, 500, runs=runs, profile_run=runs[0],
                      profile={"filter placement": 30, "bind (verb, Binding write)": 70, IDLE: 5000})
    table = size_table([size])
    row = table.splitlines()[2]
    assert "| 250 | 1808 | 500 | 60.0 / 50.0 | 120.0 / 125.0 | 0.500 / 0.400 | 0.450 |" in row
    assert "| 5.00 | 6.00 / 3.00 | 4.00 / 3.00 | 1.00 / 0.50 | 4002 | 2000 | 122.0 |" in row  # medians
    prof = profile_table([size])
    assert "% filter placement" in prof and "% prioritize" not in prof and IDLE not in prof
    assert "| 250 | 1.0 / 2.0 | 70.0 | 30.0 |" in prof  # busy samples s / extender CPU s of the run
    assert profile_table([SizeResult(250, 1808, 500, runs=runs)]) == ""
    starts = start_table([StartResult(5000, 20000, "first", ready_s=12.345, rss_mib=300.0, cache_pods=20000.0),
                          StartResult(5000, 20000, "restart", error="RuntimeError: gone")])
    assert "| 5000 | 20000 | first | 12.35 | 300.0 | 20000 |  |" in starts
    assert "| 5000 | 20000 | restart | - | - | - | RuntimeError: gone |" in starts
