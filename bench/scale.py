"""Cost per pod and how it grows with the cluster, behind the real kube-scheduler v1.36.2: `python -m bench.scale
[--sizes 250,1000,2500,5000] [--pods 1000] [--pairs 3] [--start-pods 20000,30000] [--no-profile] [--two-calls]
[--out bench/results/scale]`.

Per size (simulated GPU nodes cycling through the real topologies, a fresh control plane each: etcd and
kube-apiserver v1.36.2, tests/helpers/controlplane.py), bench.real_scheduler.run_once's alternating pairs, the
extender path (the chart's kube-scheduler configuration and extender entry: one call per pod, the extender with
`--filter-best`; `--two-calls` for filter then prioritize) and the plain path, on an identical
fresh backlog of `--pods` GPU pods (1/2/4/8 GPUs, bench.failover.burst_sizes), capped so that it asks for at most
two thirds of the size's GPUs: a backlog that fits, so every pod binds and no run measures retries of the
unplaceable. Per run: pods/s (first to last bind in kube-scheduler's log), kube-scheduler's algorithm ms per pod
(its metrics), and the CPU (utime + stime from /proc/<pid>/stat, the process and its children) that the extender,
kube-scheduler, kube-apiserver and etcd spent from just before kube-scheduler starts to the backlog's last bind,
divided by the pods bound: all of each one's work for the backlog (the extender's filter, prioritize, bind and its
watches; kube-scheduler's own start and informer lists included, as a scheduler that meets a backlog pays them).
On 2 cores the sum says whether CPU is what limits the rate. The extender's mean /filter request and answer body in
bytes (gpu_extender_request_body_bytes / gpu_extender_response_body_bytes, server side, real traffic) and its VmRSS
at the end of the run.

Where the extender's CPU goes: after the pairs, one more extender run per size with py-spy (from the venv) sampling
the extender's threads at 100 Hz without pausing it; samples whose innermost frame is a wait are idle (IDLE_LEAVES),
the others sorted into buckets (PROFILE_BUCKETS) and shown as shares of the busy ones, beside the busy samples'
seconds and the extender's CPU seconds from /proc for the same run (a check on the split). The sampler costs the
machine CPU, so that run's rate is not reported with the others.

Start to ready, on the largest size's control plane after its runs: `--start-pods` pods created already bound
(spec.nodeName and the extender's plan annotation, one GPU each, round robin over the nodes), while the nodes' state
annotations list no GPU as used, so the extender rebuilds every reservation from the pods (its slow path). Then a
fresh `gpu-extender serve`: seconds from the process's start to /readyz 200 and its VmRSS there; then SIGKILL and
the same again (a restart). Each count is reached by adding pods to the previous one.

Results: a markdown table per part printed and written to <out>.md, with .json and .png beside it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from bench.common import RESULTS, ROOT, keep_logs, machine_line, markdown_table
from bench.real_scheduler import (
    DEFAULT,
    EXTENDER,
    GPU,
    SCHEDULER_NAMES,
    RunResult,
    _fmt,
    metric_total,
    pair_ratios,
    rss_mib,
)

if TYPE_CHECKING:
    from tests.helpers.controlplane import ControlPlane

# the chart's default (scheduler.filterBest: true): one call per pod, the extender started with --filter-best and
# kube-scheduler's extender entry without prioritize (bench.real_scheduler.run_once configures both from the args)
CHART_EXTENDER_ARGS = ("--filter-best",)
MEAN_GPUS_PER_POD = 2.4  # bench.failover.SIZES: 1*0.5 + 2*0.25 + 4*0.15 + 8*0.1
FILL = 2 / 3  # the most of a size's GPUs a backlog may ask for
BOUND_NAMESPACE = "bound"

# (bucket, needles): a stack goes to the first bucket one of whose needles is in one of its frames (py-spy's
# "function (file:line)"), so the order says what wins: parsing inside a verb counts as parsing.
PROFILE_BUCKETS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("JSON parse/encode (wire, orjson)", ("extender/wire.py", "extender/http/bodies.py", "encode_answer ",
                                          "orjson")),
    ("bind (verb, Binding write)", ("bind (extender/verbs.py", "extender/binder.py", "gputopo/kube/binding.py")),
    ("prioritize", ("prioritize (extender/verbs.py",)),
    ("preempt", ("preempt (extender/verbs.py", "extender/preempt.py")),
    ("filter placement", ("filter (extender/verbs.py", "extender/placement/")),
    ("watch events, state", ("gputopo/kube/watching.py", "gputopo/kube/fetching.py", "extender/state/",
                             "extender/requeue.py")),
    ("metrics", ("prometheus_client",)),
    ("HTTP server, event loop", ("uvicorn", "h11", "httptools", "starlette", "fastapi", "asyncio",
                                 "extender/http/")),
    ("HTTP client (apiserver)", ("httpx", "httpcore", "ssl.py", "anyio")),
)
OTHER = "other"
IDLE = "idle"
# a sample whose innermost frame is one of these waits (a parked worker or anyio thread, a watch blocked on its
# stream, uvloop's C loop with no Python callback running) is a thread off the CPU
IDLE_LEAVES = ("Condition.wait (threading.py", "Event.wait (threading.py", "Runner.run (asyncio/runners.py",
               "SSLSocket.read (ssl.py", "SSLSocket.recv_into (ssl.py", "SocketIO.readinto (socket.py",
               ".select (selectors.py", "Thread.join (threading.py", "_wait_for_tstate_lock (threading.py",
               "Queue.get (queue.py", "do_poll (urllib3/util/wait.py", "sleep (")


# -- pure parts (tests/bench/test_scale.py) ----------------------------------------------------------------------


def backlog_pods(pods: int, gpus: int) -> int:
    """The backlog of a size: `pods`, or fewer where they would ask for more than FILL of its `gpus` (a backlog
    that does not fit measures kube-scheduler's retries of the unplaceable, not the cost of a placement)."""
    return max(1, min(pods, int(gpus * FILL / MEAN_GPUS_PER_POD)))


def bound_placements(gpu_ids: Mapping[str, Sequence[str]], count: int) -> list[tuple[str, str]]:
    """(node, GPU id) for `count` one-GPU pods, round robin over the nodes (each node's next free GPU), so a count
    is reached by adding pods to a smaller one's: placements(n)[:m] == placements(m). ValueError if they do not
    fit: a GPU in two plans would be a conflict the extender resolves, not the start it is timed for."""
    if count > sum(len(ids) for ids in gpu_ids.values()):
        raise ValueError(f"{count} one-GPU pods do not fit on {sum(len(i) for i in gpu_ids.values())} GPUs")
    out: list[tuple[str, str]] = []
    depth = 0
    while len(out) < count:
        for node, ids in gpu_ids.items():
            if depth < len(ids):
                out.append((node, ids[depth]))
                if len(out) == count:
                    break
        depth += 1
    return out


def profile_buckets(raw: str) -> dict[str, int]:
    """Samples per bucket from py-spy's raw output (one "frame;frame;... count" line per distinct stack; the
    first frame names the process), the samples whose innermost frame waits (IDLE_LEAVES) under IDLE."""
    out: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rstrip().rpartition(" ")
        if not stack or not n.isdigit():
            continue
        frames = stack.split(";")
        if any(frames[-1].startswith(leaf) or leaf in frames[-1] for leaf in IDLE_LEAVES):
            out[IDLE] += int(n)
            continue
        bucket = next((name for name, needles in PROFILE_BUCKETS
                       if any(needle in frame for frame in frames for needle in needles)), OTHER)
        out[bucket] += int(n)
    return dict(out)


def shares(buckets: Mapping[str, int]) -> dict[str, float]:
    """Each bucket's percent of the busy samples (IDLE left out), largest first."""
    buckets = {k: v for k, v in buckets.items() if k != IDLE}
    total = sum(buckets.values())
    return {k: round(100 * v / total, 1) for k, v in sorted(buckets.items(), key=lambda kv: -kv[1])} if total else {}


def _med(values: Iterable[float | None]) -> float | None:
    xs = [x for x in values if x is not None and x == x]
    return statistics.median(xs) if xs else None


def _joined(values: Iterable[float | None], digits: int) -> str:
    return " / ".join(_fmt(v, digits) for v in values)


@dataclass
class SizeResult:
    nodes: int
    gpus: int
    pods: int  # the backlog of each run
    runs: list[RunResult] = field(default_factory=list)  # the timed pairs
    profile_run: RunResult | None = None
    profile: dict[str, int] = field(default_factory=dict)  # samples per PROFILE_BUCKETS bucket
    setup_s: float = 0.0  # control plane and nodes


@dataclass
class StartResult:
    nodes: int
    pods: int  # bound pods in the cluster
    start: str  # "first" or "restart" (after SIGKILL)
    ready_s: float = float("nan")  # process start to /readyz 200
    rss_mib: float | None = None  # VmRSS at ready
    cache_pods: float | None = None  # gpu_extender_cache_pods at ready: the pods it rebuilt from
    create_s: float = 0.0  # creating the pods added for this count (not part of the start)
    error: str = ""


def cpu_of(runs: Sequence[RunResult], path: str, component: str) -> float | None:
    return _med(r.cpu_ms_per_pod.get(component) for r in runs if r.path == path)


def size_table(sizes: Sequence[SizeResult]) -> str:
    """One row per size: per pair pods/s of each path and their ratio, then medians over the pair runs."""
    rows = []
    for s in sizes:
        pairs = pair_ratios(s.runs)
        ext = [r for r in s.runs if r.path == EXTENDER]
        dft = [r for r in s.runs if r.path == DEFAULT]
        ratios = [p["ratio_extender_over_default"] for p in pairs]
        rows.append([
            s.nodes, s.gpus, s.pods,
            _joined((p["extender_pods_per_s"] for p in pairs), 1), _joined((p["default_pods_per_s"] for p in pairs), 1),
            _joined(ratios, 3), _fmt(_med(ratios), 3),
            f"{_fmt(_med(r.algorithm_ms for r in ext), 2)} / {_fmt(_med(r.algorithm_ms for r in dft), 2)}",
            _fmt(cpu_of(s.runs, EXTENDER, "extender"), 2),
            *(f"{_fmt(cpu_of(s.runs, EXTENDER, c), 2)} / {_fmt(cpu_of(s.runs, DEFAULT, c), 2)}"
              for c in ("kube-scheduler", "kube-apiserver", "etcd")),
            _fmt(_med(r.extender_bytes.get("filter_request") for r in ext), 0),
            _fmt(_med(r.extender_bytes.get("filter_response") for r in ext), 0),
            _fmt(_med(r.extender_rss_mib for r in ext), 1)])
    return markdown_table([
        "GPU nodes", "GPUs", "backlog pods", "pods/s extender (per pair)", "pods/s plain (per pair)",
        "ratio extender/plain (per pair)", "ratio median", "algorithm ms/pod extender / plain (median)",
        "extender CPU ms/pod", "kube-scheduler CPU ms/pod extender / plain", "kube-apiserver CPU ms/pod ext / plain",
        "etcd CPU ms/pod ext / plain", "/filter request bytes (mean, median of runs)", "/filter answer bytes",
        "extender RSS MiB (end of run)"], rows)


def profile_table(sizes: Sequence[SizeResult]) -> str:
    """Per size, each bucket's share of the extender's sampled CPU in the profiled run (columns: every bucket that
    any size has, in PROFILE_BUCKETS' order)."""
    names = [n for n, _ in PROFILE_BUCKETS] + [OTHER]
    present = [n for n in names if any(s.profile.get(n) for s in sizes)]
    rows = []
    for s in sizes:
        if not s.profile:
            continue
        pct = shares(s.profile)
        busy = sum(v for k, v in s.profile.items() if k != IDLE)
        cpu = s.profile_run.cpu_ms_per_pod.get("extender") if s.profile_run is not None else None
        cpu_s = cpu * s.profile_run.bound / 1000 if cpu is not None and s.profile_run is not None else None
        rows.append([s.nodes, f"{busy / 100:.1f} / {_fmt(cpu_s, 1)}", *(_fmt(pct.get(n), 1) for n in present)])
    header = ["GPU nodes", "busy samples s (100 Hz) / extender CPU s (/proc, backlog)",
              *(f"% {n}" for n in present)]
    return markdown_table(header, rows) if rows else ""


def start_table(starts: Sequence[StartResult]) -> str:
    return markdown_table(
        ["GPU nodes", "bound pods", "start", "process start → /readyz 200 s", "RSS MiB at ready",
         "pods in its cache", "error"],
        [[s.nodes, s.pods, s.start, _fmt(s.ready_s, 2), _fmt(s.rss_mib, 1),
          _fmt(s.cache_pods, 0), s.error] for s in starts])


# -- the cluster -------------------------------------------------------------------------------------------------


def node_gpu_ids(count: int) -> dict[str, list[str]]:
    """The GPU ids of the nodes bench.failover.add_nodes creates for `count` (the same cycle of topologies)."""
    from bench.failover import topology_files
    from gputopo.discovery.loader import load_topology_file

    topos = [load_topology_file(p) for p in topology_files()]
    return {f"gpu-{i:03d}": [g.id for g in topos[i % len(topos)].gpus] for i in range(count)}


def bound_pod_body(index: int, node: str, gpu: str) -> dict[str, Any]:
    from gputopo.contract import DEFAULT_KEYS, Plan, encode_plan

    plan = encode_plan(Plan(node, GPU, (("main", (gpu,)),), 0.0))
    return {"metadata": {"name": f"b-{index:05d}", "labels": {"bench": "scale"},
                         "annotations": {DEFAULT_KEYS.plan: plan}},
            "spec": {"nodeName": node, "schedulerName": SCHEDULER_NAMES[EXTENDER], "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "main", "image": "registry.invalid/none:0",
                                     "resources": {"limits": {GPU: "1"}, "requests": {GPU: "1"}}}]}}


def create_bound(cp: ControlPlane, placements: Sequence[tuple[str, str]], first: int, workers: int = 16) -> None:
    """Pods `first`.. of `placements`, created already bound, `workers` at a time (each its own connection: the
    apiserver's admission and etcd writes are the cost, a few ms each)."""
    cp.ensure_namespace(BOUND_NAMESPACE)
    clients = [cp.new_client() for _ in range(workers)]

    def create(i: int) -> int:
        node, gpu = placements[i]
        return clients[i % workers].post(f"/api/v1/namespaces/{BOUND_NAMESPACE}/pods",
                                         json=bound_pod_body(i, node, gpu)).status_code

    try:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            codes = Counter(pool.map(create, range(first, len(placements)), chunksize=64))
    finally:
        for c in clients:
            c.close()
    if set(codes) - {201, 409}:
        raise RuntimeError(f"creating bound pods: answers {dict(codes)}")


def timed_start(cp: ControlPlane, name: str, tree: Path, timeout: float = 900) -> tuple[float, Any]:
    """Seconds from `gpu-extender serve`'s start to its /readyz 200 (polled every 50 ms), and the Extender."""
    from bench.real_scheduler import launch_extender

    started = time.monotonic()
    ext = launch_extender(cp, name, [], tree)
    url = f"http://127.0.0.1:{ext.metrics_port}/readyz"
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return time.monotonic() - started, ext
        except httpx.HTTPError:
            pass
        if not ext.proc.running():
            raise RuntimeError(f"{name} exited before ready: {ext.proc.log_tail(1500)}")
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"{name} not ready after {timeout} s")
        time.sleep(0.05)


def start_to_ready(cp: ControlPlane, nodes: int, counts: Sequence[int], tree: Path) -> list[StartResult]:
    placements = bound_placements(node_gpu_ids(nodes), max(counts))
    out: list[StartResult] = []
    have = 0
    for count in sorted(counts):
        t0 = time.monotonic()
        create_bound(cp, placements[:count], have)
        have = count
        create_s = round(time.monotonic() - t0, 1)
        print(f"  {count} bound pods on {nodes} nodes (created in {create_s} s)", flush=True)
        ext = None
        for start in ("first", "restart"):
            result = StartResult(nodes, count, start, create_s=create_s if start == "first" else 0.0)
            try:
                if ext is not None:  # a crash, not a shutdown: nothing is flushed or handed over
                    ext.proc.popen.kill()
                    ext.proc.stop(10)
                    cp.procs.remove(ext.proc)
                ready_s, ext = timed_start(cp, f"gpu-extender-start-{count}-{start}", tree)
                result.ready_s = round(ready_s, 2)
                result.rss_mib = rss_mib(ext.proc.pid)
                result.cache_pods = metric_total(ext.metrics(), "gpu_extender_cache_pods")
            except Exception as e:  # one failed start is a row, not the end of the benchmark
                result.error = f"{type(e).__name__}: {str(e)[:300]}"
            out.append(result)
            print(f"    {start}: ready in {result.ready_s} s, RSS {result.rss_mib} MiB, "
                  f"{result.cache_pods} pods cached {result.error}", flush=True)
        if ext is not None:
            ext.proc.stop(30)
            if ext.proc in cp.procs:
                cp.procs.remove(ext.proc)
    return out


def run_size(nodes: int, pods: int, pairs: int, seed: int, timeout: float, profile_dir: Path | None,
             start_counts: Sequence[int], tree: Path, logs: Path | None = None,
             extender_args: Sequence[str] = CHART_EXTENDER_ARGS) -> tuple[SizeResult, list[StartResult]]:
    from tests.helpers.controlplane import ControlPlane

    began = time.monotonic()
    with ControlPlane() as cp:
        try:
            return _run_size(cp, nodes, pods, pairs, seed, timeout, profile_dir, start_counts, tree, began,
                             extender_args)
        finally:
            keep_logs(logs / f"{nodes}-nodes" if logs is not None else None, cp.dir)


def _run_size(cp: ControlPlane, nodes: int, pods: int, pairs: int, seed: int, timeout: float,
              profile_dir: Path | None, start_counts: Sequence[int], tree: Path,
              began: float, extender_args: Sequence[str]) -> tuple[SizeResult, list[StartResult]]:
    from bench.failover import add_nodes, burst_sizes
    from bench.real_scheduler import run_once

    allocatable = add_nodes(cp, nodes, workers=16)
    allocatable.pop("control-plane-0", None)
    gpus = sum(allocatable.values())
    backlog = backlog_pods(pods, gpus)
    sizes = burst_sizes(backlog, seed)
    result = SizeResult(nodes, gpus, backlog, setup_s=round(time.monotonic() - began, 1))
    print(f"{nodes} GPU nodes ({gpus} GPUs) in {result.setup_s} s; backlog {backlog} pods asking {sum(sizes)} "
          f"GPUs; load {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    run = 0
    common = {"sizes": sizes, "allocatable": allocatable, "extender_args": list(extender_args), "tree": tree,
              "timeout": timeout}
    for pair in range(1, pairs + 1):
        for path in (EXTENDER, DEFAULT):
            run += 1
            r = run_once(cp, run=run, pair=pair, path=path, **common)  # type: ignore[arg-type]
            result.runs.append(r)
            print(f"  run {run} {path}: {r.bound}/{r.pods} bound, {r.pods_per_s} pods/s, algorithm "
                  f"{r.algorithm_ms} ms/pod, CPU ms/pod {r.cpu_ms_per_pod}, bytes {r.extender_bytes}, RSS "
                  f"{r.extender_rss_mib} MiB, proof {r.proof.get('ok')}", flush=True)
    if profile_dir is not None:
        run += 1
        raw = profile_dir / f"extender-{nodes}-nodes.pyspy.txt"
        r = run_once(cp, run=run, pair=0, path=EXTENDER, profile=raw, **common)  # type: ignore[arg-type]
        result.profile_run = r
        result.profile = profile_buckets(raw.read_text(errors="replace")) if raw.exists() else {}
        print(f"  profiled run: {r.bound}/{r.pods} bound; buckets {shares(result.profile)}", flush=True)
    starts = start_to_ready(cp, nodes, start_counts, tree) if start_counts else []
    return result, starts


# -- report ------------------------------------------------------------------------------------------------------


def plot(sizes: Sequence[SizeResult], starts: Sequence[StartResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    xs = [s.nodes for s in sizes]
    rate, cpu, ready = axes
    for p, colour in ((EXTENDER, "tab:blue"), (DEFAULT, "tab:orange")):
        for s in sizes:
            pts = [r.pods_per_s for r in s.runs if r.path == p]
            rate.scatter([s.nodes] * len(pts), pts, color=colour, alpha=0.5, s=14)
        rate.plot(xs, [_med(r.pods_per_s for r in s.runs if r.path == p) for s in sizes], "-o", color=colour,
                  label=f"{p} path (median)")
    rate.set_xlabel("GPU nodes")
    rate.set_ylabel("pods/s")
    rate.set_title("pods/s behind kube-scheduler v1.36.2", fontsize=10)
    for component, colour in (("extender", "tab:blue"), ("kube-scheduler", "tab:green"),
                              ("kube-apiserver", "tab:red"), ("etcd", "tab:grey")):
        cpu.plot(xs, [cpu_of(s.runs, EXTENDER, component) for s in sizes], "-o", color=colour, label=component)
    cpu.plot(xs, [cpu_of(s.runs, DEFAULT, "kube-scheduler") for s in sizes], "--o", color="tab:green",
             label="kube-scheduler (plain path)")
    cpu.set_xlabel("GPU nodes")
    cpu.set_ylabel("CPU ms per pod bound")
    cpu.set_title("CPU per pod by component (extender path)", fontsize=10)
    for start, style in (("first", "-o"), ("restart", "--s")):
        pts = [s for s in starts if s.start == start and not s.error]
        ready.plot([s.pods for s in pts], [s.ready_s for s in pts], style, label=f"{start}: seconds to ready")
    ready.set_xlabel("bound pods (reservations rebuilt from them)")
    ready.set_ylabel("process start → /readyz 200, s")
    ready.set_title(f"extender start on {starts[0].nodes if starts else '-'} nodes", fontsize=10)
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _counts(text: str) -> list[int]:
    return [int(x.replace("_", "")) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=_counts, default=[250, 1000, 2500, 5000],
                        help="GPU node counts, comma-separated")
    parser.add_argument("--pods", type=int, default=1000, help="backlog per run (capped to fit each size)")
    parser.add_argument("--pairs", type=int, default=3, help="pairs of runs per size: extender, then plain")
    parser.add_argument("--start-pods", type=_counts, default=[20000, 30000],
                        help="bound pods for the start-to-ready part, on the largest size (empty: skip it)")
    parser.add_argument("--no-profile", action="store_true", help="skip the py-spy run of each size")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--timeout", type=float, default=600, help="seconds a run may take to bind its backlog")
    parser.add_argument("--out", type=Path, default=RESULTS / "scale", help="results: <out>.md .json .png")
    parser.add_argument("--keep-logs", type=Path, default=None,
                        help="copy every component's log to <dir>/<size>-nodes/")
    parser.add_argument("--two-calls", action="store_true",
                        help="filter then prioritize (scheduler.filterBest false); default: the chart's one call")
    parser.add_argument("--extender-tree", type=Path, default=ROOT, help="run the extender from this checkout")
    opts = parser.parse_args(argv)
    from tests.helpers.controlplane import skip_reason

    reason = skip_reason()
    if reason:
        print(f"bench.scale: skipped: {reason}", file=sys.stderr)
        raise SystemExit(2)
    spy = Path(sys.executable).with_name("py-spy")
    profile_dir = None if opts.no_profile or not spy.exists() else opts.out.parent / f"{opts.out.name}-profiles"
    if profile_dir is not None:
        profile_dir.mkdir(parents=True, exist_ok=True)
    elif not opts.no_profile:
        print(f"bench.scale: no {spy}: no profile (pip install -e '.[bench]' installs py-spy)", file=sys.stderr)
    load_before = os.getloadavg()
    began = time.monotonic()
    results: list[SizeResult] = []
    starts: list[StartResult] = []
    failure = ""
    largest = max(opts.sizes)
    try:
        for nodes in sorted(opts.sizes):
            size, size_starts = run_size(nodes, opts.pods, opts.pairs, opts.seed, opts.timeout, profile_dir,
                                         opts.start_pods if nodes == largest else [], opts.extender_tree,
                                         opts.keep_logs, () if opts.two_calls else CHART_EXTENDER_ARGS)
            results.append(size)
            starts += size_starts
    except RuntimeError as e:
        failure = str(e)
        print(f"bench.scale: failed: {failure.splitlines()[0]}", file=sys.stderr)
    if not results:
        raise SystemExit(1)
    total_s = round(time.monotonic() - began, 1)
    load_after = os.getloadavg()
    command = "python -m bench.scale " + " ".join(argv if argv is not None else sys.argv[1:])
    machine = (f"{machine_line()}; load average {' '.join(f'{x:.2f}' for x in load_before)} before, "
               f"{' '.join(f'{x:.2f}' for x in load_after)} after; took {total_s} s")
    tables = [size_table(results), profile_table(results), start_table(starts) if starts else ""]
    print(machine)
    for t in tables:
        if t:
            print(t + "\n")
    header = (f"# Cost per pod as the cluster grows, behind the real kube-scheduler v1.36.2\n\n`{command}`\n\n"
              f"{machine}.\n\n{__doc__.split(chr(10) + chr(10), 1)[1].strip()}\n\n"
              "Cells with two values: extender path / plain path. CPU ms/pod: medians over the pair runs of each "
              "path. Bytes: the mean body per /filter of each extender run, median over runs.\n\n")
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.with_suffix(".md").write_text(header + "\n\n".join(t for t in tables if t) + "\n")
    opts.out.with_suffix(".json").write_text(json.dumps({
        "command": command, "machine": machine_line(), "load_before": load_before, "load_after": load_after,
        "total_s": total_s, "failure": failure, "sizes": [asdict(s) for s in results],
        "profiles": {s.nodes: shares(s.profile) for s in results},
        "starts": [asdict(s) for s in starts]}, indent=1, default=str))
    plot(results, starts, opts.out.with_suffix(".png"))
    print(f"wrote {opts.out.with_suffix('.md')}, .json, .png")
    if failure or any(not r.proof.get("ok") or r.bound < r.pods for s in results for r in s.runs) \
            or any(s.error for s in starts):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
