"""Throughput behind the real kube-scheduler: `python -m bench.real_scheduler [--nodes 246] [--pods 300] [--pairs 3]
[--seed 7] [--extender-arg=--filter-best ...] [--extender-tree PATH] [--out bench/results/real_scheduler]`.

etcd and kube-apiserver v1.36.2 (tests/helpers/controlplane.py; binaries from shared/kube beside the clone), `--nodes`
simulated GPU Nodes cycling through the real topologies (bench.failover.topology_files), created as add_gpu_node
does (capacity nvidia.com/gpu, the plugin's topology and state annotations; no kubelet, no plugin). Then runs that
alternate, `--pairs` times: the extender path, then the plain path, each on an identical fresh backlog:

- extender path: a fresh `gpu-extender serve` (one replica, no leader election, reservations held 600 s; from
  `--extender-tree`, with every `--extender-arg`), then a kube-scheduler whose only profile is the chart's
  (schedulerName gpu-topology-scheduler, percentageOfNodesToScore 100, enableProfiling false) with the chart's
  extender entry (tests.helpers.controlplane.extender_stanza: filter, prioritize, bind, preempt, weight 5,
  nodeCacheCapable, httpTimeout 5s, not ignorable, managedResources nvidia.com/gpu; with `--filter-best` among the
  extender args, without prioritize and weight, as the chart sets scheduler.filterBest);
- plain path: a kube-scheduler with no extender, profile default-scheduler, percentageOfNodesToScore 100.

Both at client QPS 500 / burst 1000. The backlog (`--pods` GPU pods, 1/2/4/8 GPUs as bench.failover.burst_sizes,
shuffled with `--seed`; the same sizes every run) is created in a fresh namespace naming the run's scheduler before
that scheduler starts, so each scheduler meets a whole backlog and the two never see each other's pods (one runs at
a time; each has only its own profile). After a run its pods are deleted (grace 0) and the next run waits until
none is left, so every run starts from empty nodes; the extender is started anew for each extender run and must
report no reservation before its backlog is created.

Measured: from kube-scheduler's own log, the first to the last "Successfully bound pod to node" of the backlog and
pods/s = (pods - 1) / that span; from its /metrics at the end of the run, per scheduled pod:
scheduler_scheduling_algorithm_duration_seconds (the cycle's algorithm, which on the extender path includes the
extender's /filter and /prioritize round trips), scheduler_framework_extension_point_duration_seconds for Filter and
Score (kube-scheduler's own plugins, over every node), scheduler_scheduling_attempt_duration_seconds; and the
extender's own gpu_extender_request_seconds per verb (server side), its mean request and answer body per verb
(gpu_extender_request_body_bytes / gpu_extender_response_body_bytes) and its VmRSS at the end of the run. Quality
on the extender path: every bound pod's plan annotation (bench.failover.prove_no_double_allocation): no GPU in two
plans of one node, none over allocatable.
The machine's load average (os.getloadavg) is taken before each run. Results: <out>.md, .json, .png.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from bench.common import RESULTS, ROOT, keep_logs, machine_line, markdown_table

if TYPE_CHECKING:  # the harness is imported lazily, so that --help and the tests of the pure parts work anywhere
    from tests.helpers.controlplane import ControlPlane, Proc

GPU = "nvidia.com/gpu"
EXTENDER, DEFAULT = "extender", "default"
SCHEDULER_NAMES = {EXTENDER: "gpu-topology-scheduler", DEFAULT: "default-scheduler"}  # the chart's, the built-in
QPS, BURST = 500, 1000
BIND_LINE = re.compile(r'^I(\d{4}) (\d\d:\d\d:\d\d\.\d+)\s.*"Successfully bound pod to node" pod="([^"]+)"')
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
EXTENSION_POINTS = ("PreFilter", "Filter", "PostFilter", "PreScore", "Score", "Reserve", "Permit", "PreBind", "Bind")
EXTENDER_VERBS = ("filter", "prioritize", "bind", "preempt")
CPU_COLUMNS = ("kube-scheduler", "extender", "kube-apiserver", "etcd")


# -- pure parts (tests/bench/test_real_scheduler.py) -------------------------------------------------------------


def parse_binds(text: str, namespace: str, year: int | None = None) -> dict[str, float]:
    """Pod name -> epoch seconds of kube-scheduler's first `Successfully bound pod to node` line for it in
    `namespace` (klog's header: month, day and time in the local zone; the year is taken as `year`, else this one)."""
    year = year or datetime.datetime.now().year
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = BIND_LINE.match(line)
        if m and m.group(3).startswith(f"{namespace}/"):
            when = datetime.datetime.strptime(f"{year}{m.group(1)} {m.group(2)}", "%Y%m%d %H:%M:%S.%f")
            out.setdefault(m.group(3).split("/", 1)[1], when.timestamp())
    return out


def metric_total(text: str, name: str, **labels: str) -> float:
    """Sum of the samples named exactly `name` in a Prometheus text exposition whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = SAMPLE.match(line.strip())
        if not m or m.group(1) != name:
            continue
        have = dict(LABEL.findall(m.group(2) or ""))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def histogram(text: str, name: str, **labels: str) -> tuple[float, float]:
    """(sum, count) of histogram `name` over the series whose labels include `labels`."""
    return metric_total(text, f"{name}_sum", **labels), metric_total(text, f"{name}_count", **labels)


def mean_ms(text: str, name: str, **labels: str) -> float | None:
    """Mean of histogram `name` in milliseconds (None when it has no observation)."""
    total, count = histogram(text, name, **labels)
    return round(1000 * total / count, 3) if count else None


def span_rate(times: Sequence[float]) -> tuple[float, float]:
    """(seconds from the first to the last bind, pods/s over that span: (n - 1) / seconds); nan when under 2."""
    if len(times) < 2:
        return float("nan"), float("nan")
    ordered = sorted(times)
    seconds = ordered[-1] - ordered[0]
    return round(seconds, 3), (round((len(ordered) - 1) / seconds, 1) if seconds > 0 else float("inf"))


def _iso(ts: str) -> float:
    return datetime.datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def _pct(values: Sequence[float], q: float) -> float | None:
    from bench.common import percentile

    return round(percentile(values, q), 1) if values else None


def _json_records(text: str, needles: Sequence[str]) -> list[dict[str, Any]]:
    """The JSON objects of a log's lines holding one of `needles`; two processes writing one file (the extender and
    its bind worker) sometimes run two records together on a line, so each line is decoded object by object."""
    decoder = json.JSONDecoder()
    out = []
    for line in text.splitlines():
        if not any(n in line for n in needles):
            continue
        at = 0
        while at < len(line):
            try:
                rec, at = decoder.raw_decode(line, at)
            except ValueError:
                break
            if isinstance(rec, dict):
                out.append(rec)
            while at < len(line) and line[at].isspace():
                at += 1
    return out


def extender_log_figures(text: str, namespace: str, scheduler_binds: dict[str, float]) -> dict[str, Any]:
    """From the extender's JSON log (UTC timestamps), per pod of `namespace`: `extender.bind.planned` (the /bind
    verb reserved the GPUs) to `kube.pod.bound` (its Binding written), and that to kube-scheduler's bind line (the
    /bind answer back, and klog); p50/p90 in ms."""
    planned: dict[str, float] = {}
    bound: dict[str, float] = {}
    for rec in _json_records(text, ('"extender.bind.planned"', '"kube.pod.bound"')):
        if rec.get("event") == "extender.bind.planned" and str(rec.get("pod", "")).startswith(f"{namespace}/"):
            planned.setdefault(rec["pod"].split("/", 1)[1], _iso(rec["timestamp"]))
        elif rec.get("event") == "kube.pod.bound" and rec.get("namespace") == namespace:
            bound.setdefault(rec["pod"], _iso(rec["timestamp"]))
    to_bound = [1000 * (bound[p] - t) for p, t in planned.items() if p in bound]
    to_line = [1000 * (scheduler_binds[p] - t) for p, t in bound.items() if p in scheduler_binds]
    return {"planned": len(planned), "bound": len(bound),
            "planned_to_bound_ms_p50": _pct(to_bound, 50), "planned_to_bound_ms_p90": _pct(to_bound, 90),
            "bound_to_scheduler_line_ms_p50": _pct(to_line, 50), "bound_to_scheduler_line_ms_p90": _pct(to_line, 90)}


def stat_cpu_seconds(stat: str, ticks: int) -> tuple[int, float]:
    """(ppid, utime + stime in seconds) from a /proc/<pid>/stat line (fields after the command's closing paren)."""
    rest = stat[stat.rindex(")") + 2:].split()
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / ticks


def vm_rss_mib(status: str) -> float | None:
    """VmRSS in MiB from the text of /proc/<pid>/status (None when absent: a zombie has no memory line)."""
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return None


def rss_mib(pid: int) -> float | None:
    try:
        return vm_rss_mib(Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return None


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of `pid` and its live descendants (the extender's bind worker)."""
    ticks = os.sysconf("SC_CLK_TCK")
    procs: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                procs[int(entry)] = stat_cpu_seconds(Path(f"/proc/{entry}/stat").read_text(), ticks)
            except (OSError, ValueError, IndexError):
                continue
    total, todo, seen = 0.0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen or p not in procs:
            continue
        seen.add(p)
        total += procs[p][1]
        todo += [c for c, (ppid, _) in procs.items() if ppid == p]
    return total


@dataclass
class RunResult:
    run: int
    pair: int
    path: str  # EXTENDER or DEFAULT
    namespace: str
    pods: int
    load_before: tuple[float, float, float]
    bound: int = 0
    seconds: float = float("nan")  # first to last bind, kube-scheduler's log clock
    pods_per_s: float = float("nan")
    ready_to_first_bind_s: float = float("nan")  # scheduler /healthz answered -> first bind (informers, queue)
    wall_s: float = 0.0  # the whole run: extender start, backlog, scheduler, binds, checks, clean-up
    attempts: dict[str, float] = field(default_factory=dict)  # scheduler_schedule_attempts_total by result
    algorithm_ms: float | None = None  # scheduler_scheduling_algorithm_duration_seconds, mean per attempt
    attempt_ms: float | None = None  # scheduler_scheduling_attempt_duration_seconds{result=scheduled}, mean
    extension_points_ms: dict[str, float] = field(default_factory=dict)  # mean per cycle, kube-scheduler plugins
    extender_ms: dict[str, float] = field(default_factory=dict)  # gpu_extender_request_seconds mean per verb
    extender_calls: dict[str, int] = field(default_factory=dict)
    outside_plugins_ms: float | None = None  # algorithm - (PreFilter+Filter+PreScore+Score): extender calls, misc
    extender_log: dict[str, Any] = field(default_factory=dict)  # extender_log_figures
    # CPU ms per pod bound, from kube-scheduler's start to the end of the binds (/proc; kube-scheduler's own start
    # included; the extender's process tree: server and bind worker)
    cpu_ms_per_pod: dict[str, float] = field(default_factory=dict)
    # the extender's mean body bytes per request of each verb it answered, request and answer
    # (gpu_extender_request_body_bytes / gpu_extender_response_body_bytes), e.g. {"filter_request": 2100.0}
    extender_bytes: dict[str, float] = field(default_factory=dict)
    extender_rss_mib: float | None = None  # VmRSS of the extender at the end of its run, before it is stopped
    profile: str = ""  # the py-spy raw profile of the extender over this run, when one was taken (not timed)
    proof: dict[str, Any] = field(default_factory=dict)
    series: list[float] = field(default_factory=list)  # bind times, seconds since the run's first bind
    error: str = ""


def cycle_figures(result: RunResult, scheduler_metrics: str, extender_metrics: str | None) -> None:
    """Fill `result`'s per-pod cycle costs from kube-scheduler's and (extender path) the extender's /metrics text."""
    profile = SCHEDULER_NAMES[result.path]
    result.attempts = {r: metric_total(scheduler_metrics, "scheduler_schedule_attempts_total", result=r,
                                       profile=profile) for r in ("scheduled", "unschedulable", "error")}
    result.algorithm_ms = mean_ms(scheduler_metrics, "scheduler_scheduling_algorithm_duration_seconds")
    result.attempt_ms = mean_ms(scheduler_metrics, "scheduler_scheduling_attempt_duration_seconds",
                                result="scheduled", profile=profile)
    result.extension_points_ms = {}
    for ep in EXTENSION_POINTS:
        ms = mean_ms(scheduler_metrics, "scheduler_framework_extension_point_duration_seconds", extension_point=ep,
                     profile=profile)
        if ms is not None:
            result.extension_points_ms[ep] = ms
    if result.algorithm_ms is not None:
        inside = sum(result.extension_points_ms.get(ep, 0.0) for ep in ("PreFilter", "Filter", "PreScore", "Score"))
        result.outside_plugins_ms = round(result.algorithm_ms - inside, 3)
    if extender_metrics is not None:
        for verb in EXTENDER_VERBS:
            total, count = histogram(extender_metrics, "gpu_extender_request_seconds", verb=verb)
            if count:
                result.extender_ms[verb] = round(1000 * total / count, 3)
                result.extender_calls[verb] = int(count)
            for side in ("request", "response"):
                total, count = histogram(extender_metrics, f"gpu_extender_{side}_body_bytes", verb=verb)
                if count:
                    result.extender_bytes[f"{verb}_{side}"] = round(total / count, 1)


def pair_ratios(results: Sequence[RunResult]) -> list[dict[str, Any]]:
    """Per pair: the extender run's pods/s over the plain run's (the extender path's share of plain throughput), and
    the algorithm's ms/pod the other way round (how many times dearer the extender path's cycle is)."""
    out = []
    for pair in sorted({r.pair for r in results}):
        ext = next((r for r in results if r.pair == pair and r.path == EXTENDER), None)
        dft = next((r for r in results if r.pair == pair and r.path == DEFAULT), None)
        if ext is None or dft is None:
            continue
        ratio = round(ext.pods_per_s / dft.pods_per_s, 3) if dft.pods_per_s and dft.pods_per_s == dft.pods_per_s \
            else float("nan")
        algo = (round(ext.algorithm_ms / dft.algorithm_ms, 1) if ext.algorithm_ms and dft.algorithm_ms
                else float("nan"))
        out.append({"pair": pair, "extender_pods_per_s": ext.pods_per_s, "default_pods_per_s": dft.pods_per_s,
                    "ratio_extender_over_default": ratio, "algorithm_ms_extender_over_default": algo})
    return out


def _fmt(x: float | None, digits: int = 2) -> str:
    if x is None or x != x:
        return "-"
    return f"{x:.{digits}f}"


def table(results: Sequence[RunResult]) -> str:
    """One row per run: the figures of record, the pair's ratio on the run that closes the pair."""
    ratios = {p["pair"]: p["ratio_extender_over_default"] for p in pair_ratios(results)}
    rows = []
    for r in results:
        ep = r.extension_points_ms
        ext = "/".join(_fmt(r.extender_ms.get(v), 2) for v in ("filter", "prioritize", "bind")) \
            if r.path == EXTENDER else "-"
        closes = r.path == DEFAULT and r.pair in ratios
        proof = r.proof
        twice = len(proof.get("given_twice", [])) if r.path == EXTENDER else "-"
        rows.append([r.run, r.pair, r.path, _fmt(r.load_before[0]), f"{r.bound}/{r.pods}", _fmt(r.seconds, 3),
                     _fmt(r.pods_per_s, 1), _fmt(r.algorithm_ms, 3), _fmt(ep.get("Filter"), 3),
                     _fmt(ep.get("Score"), 3), ext, int(r.attempts.get("unschedulable", 0)),
                     int(r.attempts.get("error", 0)), twice, len(proof.get("over_allocatable", [])),
                     _fmt(ratios[r.pair], 3) if closes else "", _fmt(r.wall_s, 1)])
    return markdown_table(["run", "pair", "path", "load1 before", "bound", "seconds (first→last bind)", "pods/s",
                           "algorithm ms/pod", "Filter ms/pod", "Score ms/pod",
                           "extender filter/prioritize/bind ms (server)", "unschedulable", "errors",
                           "GPUs given twice", "nodes over allocatable", "ratio extender/default (pair)",
                           "run wall s"], rows)


def where_table(results: Sequence[RunResult]) -> str:
    """Per run, per pod, in ms: the period (1000 / pods/s), kube-scheduler's attempt and algorithm, the algorithm
    outside its own plugins (on the extender path: the /filter and /prioritize round trips), the extender's server
    time for those, its /bind, from its log the Binding write after /bind planned and the answer back; and each
    component's CPU per pod."""
    rows = []
    for r in results:
        el = r.extender_log
        server = (round(r.extender_ms.get("filter", 0) + r.extender_ms.get("prioritize", 0), 3)
                  if r.extender_ms else None)
        rows.append([r.run, r.path, _fmt(1000 / r.pods_per_s if r.pods_per_s and r.pods_per_s == r.pods_per_s
                                         else None, 2),
                     _fmt(r.attempt_ms, 2), _fmt(r.algorithm_ms, 2), _fmt(r.outside_plugins_ms, 2),
                     _fmt(server, 2), _fmt(r.extender_ms.get("bind"), 1),
                     _fmt(el.get("planned_to_bound_ms_p50"), 1), _fmt(el.get("bound_to_scheduler_line_ms_p50"), 1),
                     " / ".join(_fmt(r.cpu_ms_per_pod.get(k), 1) for k in CPU_COLUMNS)])
    return markdown_table(["run", "path", "period ms/pod (1000 / pods/s)", "attempt ms (algorithm + binding)",
                           "algorithm ms", "algorithm outside plugins ms", "extender filter+prioritize ms (server)",
                           "extender bind ms (server)", "planned → Binding written ms p50 (extender log)",
                           "Binding written → scheduler bind line ms p50",
                           "CPU ms/pod: " + " / ".join(CPU_COLUMNS)], rows)


def summary(results: Sequence[RunResult]) -> str:
    """Medians per path and of the ratios, one markdown table."""
    def med(xs: list[float]) -> float:
        xs = [x for x in xs if x == x]
        return statistics.median(xs) if xs else float("nan")

    rows = []
    for path in (EXTENDER, DEFAULT):
        rs = [r for r in results if r.path == path]
        if rs:
            rows.append([path, len(rs), _fmt(med([r.pods_per_s for r in rs]), 1),
                         _fmt(med([r.seconds for r in rs]), 3),
                         _fmt(med([r.algorithm_ms or float("nan") for r in rs]), 3)])
    ratios = [p["ratio_extender_over_default"] for p in pair_ratios(results)]
    if ratios:
        rows.append(["ratio extender/default", len(ratios), _fmt(med(ratios), 3), "", ""])
    return markdown_table(["path", "runs", "median pods/s", "median seconds", "median algorithm ms/pod"], rows)


# -- the cluster and one run -------------------------------------------------------------------------------------


def pod_body(name: str, gpus: int, scheduler: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"bench": "real-scheduler"}},
            "spec": {"schedulerName": scheduler, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "main", "image": "registry.invalid/none:0",
                                     "resources": {"limits": {GPU: str(gpus)}, "requests": {GPU: str(gpus)}}}]}}


def create_backlog(cp: ControlPlane, namespace: str, sizes: Sequence[int], scheduler: str) -> None:
    client = cp.api()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda item: client.post(f"/api/v1/namespaces/{namespace}/pods",
                                                        json=pod_body(f"p-{item[0]:03d}", item[1], scheduler)),
                                enumerate(sizes)))
    bad = [a for a in answers if a.status_code != 201]
    if bad:
        raise RuntimeError(f"creating pods: {bad[0].status_code} {bad[0].text[:300]}")


@dataclass
class Extender:
    proc: Proc
    port: int
    metrics_port: int

    def metrics(self) -> str:
        return httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text


def launch_extender(cp: ControlPlane, name: str, extra: Sequence[str], tree: Path) -> Extender:
    """`gpu-extender serve` started and left to become ready (bench.scale times that)."""
    from sim.ports import free_ports
    from tests.helpers.controlplane import start_process

    port, mport = free_ports(2)
    proc = start_process(name, [
        sys.executable, "-m", "extender.cli", "serve", "--kubeconfig", str(cp.kubeconfig), "--port", str(port),
        "--metrics-port", str(mport), "--metrics-host", "127.0.0.1", "--reservation-timeout", "600",
        "--log-level", "info", *extra], cp.dir / f"{name}.log", env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=tree)
    cp.procs.append(proc)
    return Extender(proc, port, mport)


def start_extender(cp: ControlPlane, name: str, extra: Sequence[str], tree: Path) -> Extender:
    """`gpu-extender serve` from `tree` (`-m` imports the tree's code) against the apiserver as its admin, plain HTTP
    on 127.0.0.1, no leader election, reservations held 600 s; ready when /readyz answers (watches synced) and it
    holds no reservation (the previous runs' pods are gone from its view)."""
    from tests.helpers.controlplane import wait_until

    ext = launch_extender(cp, name, extra, tree)
    proc = ext.proc
    wait_until(f"{name} /readyz", lambda: httpx.get(f"http://127.0.0.1:{ext.metrics_port}/readyz", timeout=2)
               .status_code == 200, 120, proc, 0.2)
    wait_until(f"{name} holding no reservation", lambda: metric_total(ext.metrics(), "gpu_extender_reservations") == 0,
               60, proc, 0.5)
    return ext


def count_binds(path: Path, namespace: str) -> int:
    needle = f'"Successfully bound pod to node" pod="{namespace}/'
    with path.open(errors="replace") as f:
        return sum(1 for line in f if needle in line)


def clear_namespace(cp: ControlPlane, namespace: str, timeout: float = 120) -> None:
    """Delete the run's pods at once (no kubelet to end them) and wait until none is left."""
    from tests.helpers.controlplane import wait_until

    cp.request("DELETE", f"/api/v1/namespaces/{namespace}/pods", gracePeriodSeconds=0)
    wait_until(f"pods of {namespace} deleted", lambda: not cp.list_items(f"/api/v1/namespaces/{namespace}/pods"),
               timeout, None, 0.5)


def bound_anywhere(cp: ControlPlane) -> int:
    return sum(1 for p in cp.list_items("/api/v1/pods") if (p.get("spec") or {}).get("nodeName"))


def attach_py_spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """py-spy sampling every thread of `pid` (and any child) at 100 Hz, idle or not (--idle), into a raw
    (collapsed stacks) file until `pid` exits, without pausing it (--nonblocking: a paused extender misses
    kube-scheduler's 5 s timeout under load). Its own idle detection counts threads parked in Condition.wait as busy
    and --gil names the last GIL holder even when every thread waits, so the waits are told apart by their leaf
    frame afterwards (bench.scale.IDLE_LEAVES)."""
    spy = Path(sys.executable).with_name("py-spy")
    argv = [str(spy), "record", "--pid", str(pid), "--rate", "100", "--format", "raw", "--output", str(out),
            "--subprocesses", "--idle", "--nonblocking"]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def run_once(cp: ControlPlane, *, run: int, pair: int, path: str, sizes: Sequence[int], allocatable: dict[str, int],
             extender_args: Sequence[str], tree: Path, timeout: float, profile: Path | None = None) -> RunResult:
    """One backlog through one path; every process it starts is stopped by pid and its pods deleted before it
    returns. With `profile` (extender path) py-spy samples the extender from before the backlog until it is stopped
    and writes its stacks there: the sampler's pauses slow the extender, so such a run's figures are not timings."""
    from bench.failover import prove_no_double_allocation
    from tests.helpers.controlplane import extender_stanza

    started = time.monotonic()
    namespace = f"{path}-{pair}"
    leftover = bound_anywhere(cp)
    if leftover:
        raise RuntimeError(f"{leftover} pods still bound before run {run}: nodes not reset")
    result = RunResult(run, pair, path, namespace, len(sizes), os.getloadavg())
    cp.ensure_namespace(namespace)
    ext: Extender | None = None
    sched = None
    spy: subprocess.Popen[bytes] | None = None
    try:
        stanzas = []
        if path == EXTENDER:
            ext = start_extender(cp, f"gpu-extender-{run}", extender_args, tree)
            stanza = extender_stanza(f"http://127.0.0.1:{ext.port}")
            if "--filter-best" in extender_args:  # as the chart configures it: filter alone scores
                del stanza["prioritizeVerb"], stanza["weight"]
            stanzas = [stanza]
            if profile is not None:
                spy = attach_py_spy(ext.proc.pid, profile)
                result.profile = str(profile)
        create_backlog(cp, namespace, sizes, SCHEDULER_NAMES[path])
        time.sleep(1.0)  # the extender's pod watch catches up with the backlog
        watched = {p.name: p.pid for p in cp.procs if p.name in ("etcd", "kube-apiserver")}
        if ext is not None:
            watched["extender"] = ext.proc.pid
        cpu_before = {name: tree_cpu_seconds(pid) for name, pid in watched.items()}
        sched = cp.start_scheduler(stanzas, qps=QPS, burst=BURST, name=f"kube-scheduler-{run}-{path}", extra_config={
            "enableProfiling": False,
            "profiles": [{"schedulerName": SCHEDULER_NAMES[path], "percentageOfNodesToScore": 100}]})
        ready = time.time()
        deadline = time.monotonic() + timeout
        last, last_change = -1, time.monotonic()
        while time.monotonic() < deadline:
            n = count_binds(sched.log, namespace)
            if n >= len(sizes):
                break
            if n != last:
                last, last_change = n, time.monotonic()
            elif time.monotonic() - last_change > 60:
                break  # a minute without a bind: report what was bound
            time.sleep(0.25)
        watched["kube-scheduler"] = sched.proc.pid
        cpu = {name: tree_cpu_seconds(pid) - cpu_before.get(name, 0.0) for name, pid in watched.items()}
        time.sleep(0.5)
        sched_metrics = sched.metrics()
        ext_metrics = ext.metrics() if ext is not None else None
        if ext is not None:
            result.extender_rss_mib = rss_mib(ext.proc.pid)
        binds = parse_binds(sched.log.read_text(errors="replace"), namespace)
        times = sorted(binds.values())
        result.bound = len(binds)
        result.seconds, result.pods_per_s = span_rate(times)
        if times:
            result.ready_to_first_bind_s = round(times[0] - ready, 3)
            result.series = [round(t - times[0], 4) for t in times]
        cycle_figures(result, sched_metrics, ext_metrics)
        result.cpu_ms_per_pod = {k: round(1000 * v / max(1, result.bound), 2) for k, v in cpu.items()}
        if ext is not None:
            result.extender_log = extender_log_figures(ext.proc.log.read_text(errors="replace"), namespace, binds)
        proof = prove_no_double_allocation(cp, namespace, allocatable)
        result.proof = {**asdict(proof), "ok": proof.ok if path == EXTENDER else not proof.over_allocatable}
        if path == DEFAULT:  # no plans on the plain path: only the allocatable check applies
            result.proof.update(missing_plan=[], wrong_node=[], wrong_count=[], given_twice=[])
    except Exception as e:
        result.error = f"{type(e).__name__}: {e}"
        raise
    finally:
        if sched is not None:
            cp.stop_scheduler(sched)
        if ext is not None:
            ext.proc.stop(30)
            if ext.proc in cp.procs:
                cp.procs.remove(ext.proc)
        if spy is not None:  # it writes its file once the extender is gone
            try:
                spy.wait(60)
            except subprocess.TimeoutExpired:
                spy.send_signal(signal.SIGINT)
                spy.wait(30)
        clear_namespace(cp, namespace)
        result.wall_s = round(time.monotonic() - started, 1)
    return result


# -- report ------------------------------------------------------------------------------------------------------


def plot(results: Sequence[RunResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [2, 1]})
    for r in results:
        style = "-" if r.path == EXTENDER else "--"
        colour = "tab:blue" if r.path == EXTENDER else "tab:orange"
        left.plot(r.series, range(1, len(r.series) + 1), style, color=colour, drawstyle="steps-post", alpha=0.8,
                  label=f"run {r.run} {r.path} ({_fmt(r.pods_per_s, 1)}/s, load {r.load_before[0]:.1f})")
    left.set_xlabel("seconds since the run's first bind (kube-scheduler log)")
    left.set_ylabel("pods bound")
    left.set_title("pods bound over time: extender path (solid) and plain kube-scheduler (dashed)", fontsize=10)
    left.grid(alpha=0.3)
    left.legend(fontsize=7)
    pairs = pair_ratios(results)
    xs = [p["pair"] for p in pairs]
    vals = [p["ratio_extender_over_default"] for p in pairs]
    right.bar(xs, vals, color="tab:green")
    for x, v in zip(xs, vals, strict=True):
        right.annotate(_fmt(v, 3), (x, v), ha="center", va="bottom", fontsize=9)
    right.set_xticks(xs)
    right.set_xlabel("pair")
    right.set_ylabel("pods/s extender ÷ pods/s plain")
    right.set_title("throughput ratio per pair", fontsize=10)
    right.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=246, help="simulated GPU nodes (the real topologies in turn)")
    parser.add_argument("--pods", type=int, default=300, help="GPU pods in each run's backlog")
    parser.add_argument("--pairs", type=int, default=3, help="pairs of runs: extender, then plain")
    parser.add_argument("--seed", type=int, default=7, help="shuffles the backlog's sizes (the same every run)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds a run may take to bind its backlog")
    parser.add_argument("--out", type=Path, default=RESULTS / "real_scheduler", help="results: <out>.md .json .png")
    parser.add_argument("--extender-arg", action="append", default=[], metavar="ARG",
                        help="passed to gpu-extender serve; repeatable; write flags as --extender-arg=--flag")
    parser.add_argument("--extender-tree", type=Path, default=ROOT,
                        help="run the extender from this checkout (e.g. a git worktree of an older commit)")
    parser.add_argument("--keep-logs", type=Path, default=None,
                        help="copy every component's log (schedulers, extenders, apiserver) to this directory")
    opts = parser.parse_args(argv)
    from bench.failover import add_nodes, burst_sizes
    from tests.helpers.controlplane import ControlPlane, skip_reason

    reason = skip_reason()
    if reason:
        print(f"bench.real_scheduler: skipped: {reason}", file=sys.stderr)
        raise SystemExit(2)
    sizes = burst_sizes(opts.pods, opts.seed)
    results: list[RunResult] = []
    failure = ""
    began = time.monotonic()
    allocatable: dict[str, int] = {}
    try:
        with ControlPlane() as cp:
            t0 = time.monotonic()
            allocatable = add_nodes(cp, opts.nodes)
            allocatable.pop("control-plane-0", None)
            print(f"control plane at {cp.url}; {len(allocatable)} GPU nodes ({sum(allocatable.values())} GPUs) in "
                  f"{time.monotonic() - t0:.1f} s; backlog {opts.pods} pods asking {sum(sizes)} GPUs "
                  f"({dict(sorted(Counter(sizes).items()))}); extender args {opts.extender_arg}; "
                  f"tree {opts.extender_tree}", flush=True)
            run = 0
            for pair in range(1, opts.pairs + 1):
                for path in (EXTENDER, DEFAULT):
                    run += 1
                    print(f"run {run} (pair {pair}, {path}): load {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
                          flush=True)
                    r = run_once(cp, run=run, pair=pair, path=path, sizes=sizes, allocatable=allocatable,
                                 extender_args=opts.extender_arg, tree=opts.extender_tree, timeout=opts.timeout)
                    results.append(r)
                    print(f"  bound {r.bound}/{r.pods} in {r.seconds} s = {r.pods_per_s} pods/s; algorithm "
                          f"{r.algorithm_ms} ms/pod; extension points {r.extension_points_ms}; extender "
                          f"{r.extender_ms}; attempts {r.attempts}; proof ok "
                          f"{r.proof.get('ok')}; run took {r.wall_s} s", flush=True)
                    if not r.proof.get("ok"):
                        print(f"PROOF FAILED: {json.dumps(r.proof)[:2000]}", flush=True)
            keep_logs(opts.keep_logs, cp.dir)
    except RuntimeError as e:  # a component that would not start or serve: one line, then what was measured
        failure = str(e)
        print(f"bench.real_scheduler: failed: {failure.splitlines()[0]}", file=sys.stderr)
    if not results:
        raise SystemExit(1)
    total_s = round(time.monotonic() - began, 1)
    md = table(results)
    pairs_md = markdown_table(
        ["pair", "extender pods/s", "plain pods/s", "ratio extender/plain", "algorithm ms/pod extender ÷ plain"],
        [[p["pair"], _fmt(p["extender_pods_per_s"], 1), _fmt(p["default_pods_per_s"], 1),
          _fmt(p["ratio_extender_over_default"], 3), _fmt(p["algorithm_ms_extender_over_default"], 1)]
         for p in pair_ratios(results)])
    where_md = where_table(results)
    print(machine_line())
    print(md)
    print(pairs_md)
    print(summary(results))
    print(where_md)
    command = "python -m bench.real_scheduler " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (f"# Throughput behind the real kube-scheduler v1.36.2\n\n`{command}`\n\n{machine_line()}; "
              f"{len(allocatable)} GPU nodes, {sum(allocatable.values())} GPUs; each run's backlog {opts.pods} pods "
              f"asking {sum(sizes)} GPUs (seed {opts.seed}); kube-scheduler QPS {QPS} burst {BURST}, "
              f"percentageOfNodesToScore 100; extender args {opts.extender_arg or 'none'}; benchmark took "
              f"{total_s} s.\n\nRuns alternate (extender path, then plain kube-scheduler), each on a fresh namespace "
              f"and the same backlog created before its scheduler starts; a fresh extender per extender run; the "
              f"previous run's pods deleted before the next. seconds and pods/s: first to last \"Successfully bound\" "
              f"in kube-scheduler's log, pods/s = (pods - 1) / seconds. ms/pod: kube-scheduler's histograms (sum / "
              f"count); extender server times: its gpu_extender_request_seconds. load1: os.getloadavg() before the "
              f"run (the machine is shared).\n\n")
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.with_suffix(".md").write_text(header + "\n\n".join([md, pairs_md, summary(results), where_md]) + "\n")
    opts.out.with_suffix(".json").write_text(json.dumps({
        "command": command, "machine": machine_line(), "nodes": len(allocatable), "gpus": sum(allocatable.values()),
        "pods": opts.pods, "gpus_asked": sum(sizes), "seed": opts.seed, "qps": QPS, "burst": BURST,
        "extender_args": opts.extender_arg, "extender_tree": str(opts.extender_tree), "total_s": total_s,
        "failure": failure, "pairs": pair_ratios(results), "runs": [asdict(r) for r in results]}, indent=1,
        default=str))
    plot(results, opts.out.with_suffix(".png"))
    print(f"wrote {opts.out.with_suffix('.md')}, .json, .png")
    if failure or any(not r.proof.get("ok") or r.bound < r.pods for r in results):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
