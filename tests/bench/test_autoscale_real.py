"""The pure parts of the real-CA autoscaling benchmark (bench.autoscale_real): the day's load, how CA's log is read,
and how a policy's outcome is summed up. The run itself needs the real CA and is a benchmark, not a test."""

from __future__ import annotations

from bench.autoscale_real import (
    GPU,
    SHARED,
    Outcome,
    PodRecord,
    PodSpec,
    believed_fits,
    pod_object,
    scheduler_profiles,
    summary,
    tables,
    trace,
)
from gputopo.contract import DEFAULT_KEYS


def test_the_day_is_the_same_for_every_policy_and_has_every_kind() -> None:
    one, two = trace(7, 1000.0), trace(7, 1000.0)
    assert one == two and one != trace(8, 1000.0)
    kinds = {p.kind for w in one for wave in w.waves for p in wave}
    assert kinds == {"train", "trial", "single", "inference", "notebook"}
    assert all(0 <= w.arrival < 1000.0 for w in one)
    names = [p.name for w in one for wave in w.waves for p in wave]
    assert len(names) == len(set(names)), "every pod of the day has a name of its own"
    jobs = [w for w in one if w.kind == "train"]
    assert jobs and all(w.gap > 0 and len(w.waves) == 1 and len(w.waves[0]) >= 2 for w in jobs)
    assert all(p.annotations[DEFAULT_KEYS.job_size] == str(len(w.waves[0])) for w in jobs for p in w.waves[0])
    experiments = [w for w in one if w.kind == "experiment"]
    assert experiments and all(len(w.waves) >= 2 for w in experiments)


def test_a_pod_asks_cpu_and_memory_in_proportion_to_its_gpus_and_names_no_scheduler() -> None:
    whole = pod_object(PodSpec("p", "single", 4), "ours")
    res = whole["spec"]["containers"][0]["resources"]
    assert res["limits"] == {GPU: "4"} and res["requests"] == {"cpu": "28", "memory": "224Gi", GPU: "4"}
    assert "schedulerName" not in whole["spec"]
    shared = pod_object(PodSpec("i", "inference", 1, shared=True), "default")
    assert shared["spec"]["containers"][0]["resources"]["limits"] == {SHARED: "1"}


def test_most_allocated_scores_the_gpu_resources_and_default_keeps_kube_schedulers_own() -> None:
    (default,) = scheduler_profiles("default")
    assert "pluginConfig" not in default
    (packing,) = scheduler_profiles("most-allocated")
    strategy = packing["pluginConfig"][0]["args"]["scoringStrategy"]
    assert strategy["type"] == "MostAllocated" and {r["name"] for r in strategy["resources"]} == {GPU, SHARED}


def test_cas_log_is_read_for_pods_it_believed_fit_an_existing_node_in_either_release_s_words() -> None:
    log = "\n".join([
        'I1207 10:00:00.1 1 hinting_simulator.go:77] Pod bench/train-3-worker-0 can be moved to nvswitch-1',
        'I1207 10:00:00.2 1 filter_out_schedulable.go:157] Pod bench.single-4 marked as unschedulable can be '
        'scheduled on node pcie-0. Ignoring in scale up.',
        'I1207 10:00:00.3 1 hinting_simulator.go:77] Pod bench/nb-2 can be moved to template-node-for-pcie-9',
        'I1207 10:00:00.4 1 hinting_simulator.go:77] Pod other/x can be moved to pcie-1',
        'I1207 10:00:10.1 1 hinting_simulator.go:77] Pod bench/train-3-worker-0 can be moved to dgx1-0',
    ])
    assert believed_fits(log) == {"train-3-worker-0": "nvswitch-1", "single-4": "pcie-0"}


def test_the_summary_counts_what_waited_while_ca_believed_it_fits_and_what_never_bound() -> None:
    out = Outcome("ours")
    out.pods = {
        "a": PodRecord(PodSpec("a", "single", 4, {DEFAULT_KEYS.require_nvlink: "true"}), 0, 0.0, "u1", 10.0, "n-0",
                       240.0),
        "b": PodRecord(PodSpec("b", "single", 2), 1, 0.0, "u2", 100.0, "n-1", 16.0),
        "c": PodRecord(PodSpec("c", "notebook", 1), 2, 5.0),
    }
    out.node_seconds = {"nvswitch": 3600.0, "pcie": 1800.0}
    out.added, out.removed = {"nvswitch": 1, "pcie": 1}, {"pcie": 1}
    out.believed_fit = {"b": "n-0", "c": "n-1", "a": "n-1"}
    got = summary(out, 600.0)
    assert got["gpu_node_hours"] == 1.5 and got["nodes_added"] == 2 and got["nodes_removed"] == 1
    assert got["never_bound"] == ["c"]
    assert got["waited_while_ca_believed_fit"] == {"b": "n-0", "c": "n-1"}  # a bound within 60 s
    assert got["allreduce_gbps_mean"] == 128.0 and got["allreduce_gbps_mean_asked"] == 240.0
    assert got["pending_s"]["single"]["pods"] == 2 and got["pending_s"]["notebook"]["pods"] == 0
    assert got["needs_unmet"] == [] and got["needs_measured"] == 0
    assert "| ours | 1.5 | 2 / 1 (0) |" in tables([got])


def test_a_need_is_met_by_the_extenders_own_tests() -> None:
    from bench.autoscale_real import TOPOLOGIES, need_met
    from gputopo.discovery.loader import load_topology_file

    bridge = load_topology_file(TOPOLOGIES / "pcie-8x-rtxa6000-nvlinkbridge-pairs-2socket-unige-baobab.txt")
    nvlink = PodSpec("a", "single", 4, {DEFAULT_KEYS.require_nvlink: "true"})
    floor = PodSpec("b", "single", 4, {DEFAULT_KEYS.min_gbps: "100"})
    assert need_met(nvlink, bridge, 80.0) is True and need_met(nvlink, bridge, 14.0) is False
    assert need_met(floor, bridge, 80.0) is False and need_met(floor, bridge, 100.0) is True
    assert need_met(PodSpec("c", "single", 4), bridge, 14.0) is None
