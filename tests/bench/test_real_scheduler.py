"""bench/real_scheduler.py's pure parts on sample text: kube-scheduler's bind lines, Prometheus histograms, the
extender's JSON log, the per-pair ratio and the tables (the figures themselves come from running the benchmark)."""

from __future__ import annotations

import datetime
import math

from bench.real_scheduler import (
    DEFAULT,
    EXTENDER,
    RunResult,
    cycle_figures,
    extender_log_figures,
    histogram,
    metric_total,
    pair_ratios,
    parse_binds,
    span_rate,
    stat_cpu_seconds,
    summary,
    table,
    where_table,
)

SCHEDULER_LOG = """\
I1203 13:21:10.100000   16916 server.go:167] "Starting Kubernetes Scheduler" version="v1.36.2"
I1203 13:21:11.000000   16916 schedule_one.go:481] "Successfully bound pod to node" pod="extender-1/p-000" \
node="gpu-013" evaluatedNodes=21 feasibleNodes=20
I1203 13:21:11.250000   16916 schedule_one.go:481] "Successfully bound pod to node" pod="other/p-009" node="gpu-001"
I1203 13:21:11.500000   16916 schedule_one.go:481] "Successfully bound pod to node" pod="extender-1/p-001" \
node="gpu-013" evaluatedNodes=21 feasibleNodes=20
I1203 13:21:13.000000   16916 schedule_one.go:481] "Successfully bound pod to node" pod="extender-1/p-002" \
node="gpu-003" evaluatedNodes=21 feasibleNodes=13
I1203 13:21:14.000000   16916 schedule_one.go:481] "Successfully bound pod to node" pod="extender-1/p-000" \
node="gpu-013"
E1203 13:21:15.000000   16916 run.go:72] "command failed" err="finished without leader elect"
"""

SCHEDULER_METRICS = """\
# HELP scheduler_scheduling_algorithm_duration_seconds [ALPHA] Scheduling algorithm latency in seconds
# TYPE scheduler_scheduling_algorithm_duration_seconds histogram
scheduler_scheduling_algorithm_duration_seconds_bucket{le="0.001"} 0
scheduler_scheduling_algorithm_duration_seconds_bucket{le="+Inf"} 4
scheduler_scheduling_algorithm_duration_seconds_sum 0.08
scheduler_scheduling_algorithm_duration_seconds_count 4
scheduler_scheduling_attempt_duration_seconds_sum{profile="gpu-topology-scheduler",result="scheduled"} 0.4
scheduler_scheduling_attempt_duration_seconds_count{profile="gpu-topology-scheduler",result="scheduled"} 4
scheduler_framework_extension_point_duration_seconds_sum{extension_point="Filter",profile="gpu-topology-scheduler",\
status="Success"} 0.003
scheduler_framework_extension_point_duration_seconds_count{extension_point="Filter",profile="gpu-topology-scheduler",\
status="Success"} 3
scheduler_framework_extension_point_duration_seconds_sum{extension_point="Filter",profile="gpu-topology-scheduler",\
status="Unschedulable"} 0.001
scheduler_framework_extension_point_duration_seconds_count{extension_point="Filter",profile="gpu-topology-scheduler",\
status="Unschedulable"} 1
scheduler_framework_extension_point_duration_seconds_sum{extension_point="Score",profile="gpu-topology-scheduler",\
status="Success"} 0.002
scheduler_framework_extension_point_duration_seconds_count{extension_point="Score",profile="gpu-topology-scheduler",\
status="Success"} 4
scheduler_framework_extension_point_duration_seconds_sum{extension_point="Filter",profile="default-scheduler",\
status="Success"} 9
scheduler_framework_extension_point_duration_seconds_count{extension_point="Filter",profile="default-scheduler",\
status="Success"} 1
scheduler_schedule_attempts_total{profile="gpu-topology-scheduler",result="scheduled"} 3
scheduler_schedule_attempts_total{profile="gpu-topology-scheduler",result="unschedulable"} 1
scheduler_schedule_attempts_total_extra{profile="gpu-topology-scheduler",result="scheduled"} 100
"""

EXTENDER_METRICS = """\
gpu_extender_request_seconds_sum{verb="filter"} 0.004
gpu_extender_request_seconds_count{verb="filter"} 4
gpu_extender_request_seconds_sum{verb="prioritize"} 0.002
gpu_extender_request_seconds_count{verb="prioritize"} 4
gpu_extender_request_seconds_sum{verb="bind"} 0.2
gpu_extender_request_seconds_count{verb="bind"} 4
"""

EXTENDER_LOG = """\
{"host": "127.0.0.1", "event": "extender.server.listening", "level": "info", "timestamp": "2026-12-03T13:21:06.7Z"}
{"pod": "extender-1/p-000", "node": "gpu-013", "event": "extender.bind.planned", "timestamp": "2026-12-03T13:21:10.600000Z"}
{"namespace": "extender-1", "pod": "p-000", "node": "gpu-013", "event": "kube.pod.bound", "timestamp": "2026-12-03T13:21:10.650000Z"}
{"pod": "extender-1/p-001", "node": "gpu-013", "event": "extender.bind.planned", "timestamp": "2026-12-03T13:21:11.000000Z"}{"namespace": "extender-1", "pod": "p-001", "node": "gpu-013", "event": "kube.pod.bound", "timestamp": "2026-12-03T13:21:11.200000Z"}
{"pod": "other/p-000", "node": "gpu-013", "event": "extender.bind.planned", "timestamp": "2026-12-03T13:21:11.0Z"}
not json
"""  # noqa: E501


def test_parse_binds_keeps_the_namespace_and_the_first_line_per_pod() -> None:
    binds = parse_binds(SCHEDULER_LOG, "extender-1", year=2026)
    assert sorted(binds) == ["p-000", "p-001", "p-002"]
    base = datetime.datetime(2026, 12, 3, 13, 21, 11).timestamp()
    assert binds["p-000"] == base  # the repeated line at :14 does not count
    assert math.isclose(binds["p-001"] - base, 0.5) and math.isclose(binds["p-002"] - base, 2.0)
    assert parse_binds(SCHEDULER_LOG, "nobody", year=2026) == {}


def test_span_rate() -> None:
    assert span_rate([3.0, 1.0, 2.0, 5.0]) == (4.0, 0.8)  # (n - 1) / first-to-last
    seconds, rate = span_rate([1.0])
    assert math.isnan(seconds) and math.isnan(rate)


def test_metric_parsing_is_exact_on_names_and_labels() -> None:
    assert metric_total(SCHEDULER_METRICS, "scheduler_schedule_attempts_total", result="scheduled") == 3
    assert metric_total(SCHEDULER_METRICS, "scheduler_schedule_attempts_total") == 4
    assert histogram(SCHEDULER_METRICS, "scheduler_scheduling_algorithm_duration_seconds") == (0.08, 4)
    assert histogram(SCHEDULER_METRICS, "scheduler_framework_extension_point_duration_seconds",
                     extension_point="Filter", profile="gpu-topology-scheduler") == (0.004, 4)
    assert metric_total(SCHEDULER_METRICS, "missing") == 0


def test_cycle_figures_per_pod() -> None:
    r = RunResult(1, 1, EXTENDER, "extender-1", 4, (1.0, 1.0, 1.0))
    cycle_figures(r, SCHEDULER_METRICS, EXTENDER_METRICS)
    assert r.attempts == {"scheduled": 3, "unschedulable": 1, "error": 0}
    assert r.algorithm_ms == 20.0 and r.attempt_ms == 100.0
    assert r.extension_points_ms == {"Filter": 1.0, "Score": 0.5}  # the default profile's series left out
    assert r.outside_plugins_ms == 18.5
    assert r.extender_ms == {"filter": 1.0, "prioritize": 0.5, "bind": 50.0}
    assert r.extender_calls == {"filter": 4, "prioritize": 4, "bind": 4}


def test_extender_log_figures() -> None:
    sched = {"p-000": datetime.datetime(2026, 12, 3, 13, 21, 10, 700000, tzinfo=datetime.UTC).timestamp(),
             "p-001": datetime.datetime(2026, 12, 3, 13, 21, 11, 300000, tzinfo=datetime.UTC).timestamp()}
    got = extender_log_figures(EXTENDER_LOG, "extender-1", sched)  # two records run together on one line count
    assert got["planned"] == 2 and got["bound"] == 2
    assert got["planned_to_bound_ms_p50"] == 50.0 and got["planned_to_bound_ms_p90"] == 200.0
    assert got["bound_to_scheduler_line_ms_p50"] == 50.0 and got["bound_to_scheduler_line_ms_p90"] == 100.0


def _run(run: int, pair: int, path: str, rate: float, algo: float) -> RunResult:
    r = RunResult(run, pair, path, f"{path}-{pair}", 300, (2.5, 2.0, 1.0), bound=300, seconds=299 / rate,
                  pods_per_s=rate, algorithm_ms=algo)
    r.proof = {"given_twice": [], "over_allocatable": [], "ok": True}
    return r


def test_pair_ratios_and_tables() -> None:
    results = [_run(1, 1, EXTENDER, 50.0, 20.0), _run(2, 1, DEFAULT, 200.0, 4.0),
               _run(3, 2, EXTENDER, 40.0, 25.0), _run(4, 2, DEFAULT, 160.0, 5.0), _run(5, 3, EXTENDER, 45.0, 21.0)]
    pairs = pair_ratios(results)
    assert [p["pair"] for p in pairs] == [1, 2]  # pair 3 has no plain run
    assert pairs[0]["ratio_extender_over_default"] == 0.25 and pairs[1]["ratio_extender_over_default"] == 0.25
    assert pairs[0]["algorithm_ms_extender_over_default"] == 5.0
    md = table(results)
    lines = md.splitlines()
    assert len(lines) == 2 + len(results)
    assert "| 2 | 1 | default | 2.50 | 300/300 |" in lines[3] and "| 0.250 |" in lines[3]
    assert "| 0.250 |" not in lines[2]  # the ratio sits on the run that closes the pair
    s = summary(results)
    assert "| extender | 3 | 45.0 |" in s and "| default | 2 | 180.0 |" in s
    assert "| ratio extender/default | 2 | 0.250 |" in s
    assert "| 1 | extender | 20.00 |" in where_table(results)


def test_stat_cpu_seconds_reads_past_a_command_with_spaces_and_parens() -> None:
    stat = "4242 (python (x) y) S 4200 4242 4242 0 -1 4194560 100 0 0 0 250 50 7 3 20 0 8 0 1000 0 0"
    assert stat_cpu_seconds(stat, 100) == (4200, 3.0)  # utime 250 + stime 50 ticks, not the children's 7 + 3
