"""The autoscaling benchmark of record, decided by the real Cluster Autoscaler 1.31.5: `python -m bench.autoscale_real
[--minutes 24] [--seed 20261207] [--out bench/results/autoscale-real] [--quick]`.

A compressed day of mixed GPU work on node groups the real CA grows and shrinks, three policies side by side in one
run, each on a control plane of its own (etcd, kube-apiserver and kube-scheduler v1.36.2, tests/helpers/controlplane)
with CA and the project's externalgrpc cloud (sim.ca_provider: scale-up = a Node registered with the template's
labels, the real `gpuplugin run` on a simulated kubelet that admits pods as the kubelet's device manager does;
scale-down = both stopped, the Node deleted):

  default          kube-scheduler's default profile (LeastAllocated); the GPUs on a node are the device plugin's
                   GetPreferredAllocation (ours stands in for NVIDIA's, whose gpuallocator also prefers NVLink)
  most-allocated   the same, NodeResourcesFit MostAllocated on the GPU resources (bin-packing for autoscaling)
  ours             the chart: extender, its second scheduler, the admission webhook (tests.helpers.chart_install)

Node groups (real topologies, fixtures/topologies): HGX A100 (NVSwitch), DGX-1 V100 (NVLink cube mesh), 8x RTX A6000
in NVLink-bridge pairs, 8x RTX 5090 (PCIe only), and 4x L40S time-sliced (4 replicas a GPU, renamed
`nvidia.com/gpu.shared`, no GPU label: a renamed node advertises no `nvidia.com/gpu`). All start at zero.

The load (seeded, the same for every policy): training jobs of 2-4 pods asking 4 or 8 GPUs and NVLink, created pod by
pod as a training operator does (2 s apart; a job runs once all its pods are bound, and ends as a whole); Katib-style
experiments (waves of 4-6 parallel single-GPU trials, the next wave once the last ends); single 2/4/8-GPU pods, some
asking NVLink or 100 GB/s; inference replicas of one shared GPU; notebooks of one GPU. Pods ask CPU and memory in
proportion to their GPUs (7 CPUs and 56 GiB a GPU), as GPU pods do, so kube-scheduler's scoring sees them. Arrivals
come over the first 70 % of the run, denser in the day's middle; the rest lets the work end and CA remove nodes.

CA's clock is compressed (`--scan-interval=10s`, a node unneeded for 60 s is removed, no delays after adds or
deletes); what it cannot compress is its 30 s wait for GPU pods younger than 30 s. New nodes are up in seconds here,
where a cloud takes minutes. Each policy runs until its day's work has ended and CA has removed every node (at most
15 minutes past the day), so a policy that delays work pays for the nodes that work keeps. Measured per policy: GPU
node-hours (nodes counted from the moment CA asks for them until they are gone, as a cloud bills them), nodes added
and removed, pending time (creation to bound) p50
and p95 per workload kind, a training job's time from its first pod's creation to its last pod bound, all-reduce GB/s
of each multi-GPU pod's GPUs as the kubelet allocated them, pods asking NVLink or a floor whose GPUs do not meet
it (the extender's own tests), pods that failed admission, pods never bound, and every
pod CA's own log says "can be scheduled on" an existing node while it waited (a pod CA believed fits). Results:
<out>.md, .json, .png.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import math
import random
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import RESULTS, ROOT, machine_line, markdown_table, percentile

TOPOLOGIES = ROOT / "fixtures" / "topologies"
NS = "bench"
GPU = "nvidia.com/gpu"
SHARED = "nvidia.com/gpu.shared"
POLICIES = ("default", "most-allocated", "ours")
KINDS = ("train", "trial", "single", "inference", "notebook")
RENAMED_TIME_SLICING = ("version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n    resources:\n"
                        "    - name: nvidia.com/gpu\n      replicas: 4\n")
CPU_PER_GPU, MEM_PER_GPU_GI = 7, 56


@dataclass(frozen=True)
class Group:
    id: str
    fixture: str
    max_size: int
    gpu_type: str
    shared: bool = False


GROUPS = (
    Group("nvswitch", "hgx-a100-8gpu-epyc7763-pleiades", 6, "a100"),
    Group("dgx1", "dgx1-v100-pytorch-ddp-bench", 3, "v100"),
    Group("bridge", "pcie-8x-rtxa6000-nvlinkbridge-pairs-2socket-unige-baobab", 2, "rtxa6000"),
    Group("pcie", "pcie-8x-rtx5090-2socket-sglang23020", 3, "rtx5090"),
    Group("shared", "aws-g6e.12xlarge-4xL40S", 2, "l40s", shared=True),
)


# -- the load --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodSpec:
    """One pod of a work item: its name, kind, GPUs (replicas when shared) and annotations."""

    name: str
    kind: str
    gpus: int
    annotations: Mapping[str, str] = field(default_factory=dict)
    labels: Mapping[str, str] = field(default_factory=dict)
    shared: bool = False


@dataclass(frozen=True)
class Work:
    """An arrival: one pod, a job of pods created `gap` s apart that runs as a whole, or an experiment of waves."""

    id: int
    arrival: float
    kind: str
    waves: tuple[tuple[PodSpec, ...], ...]  # one wave for everything but experiments
    duration: float  # seconds each wave runs once all its pods are bound
    gap: float = 0.0


def _rate_shape(x: float) -> float:
    """Arrival density over the arrival window, x in [0, 1): a day, quiet at its ends."""
    return 0.35 + math.sin(math.pi * x) ** 2


def trace(seed: int, window_s: float, scale: float = 1.0) -> list[Work]:
    """The day's arrivals over `window_s` seconds; `scale` shortens durations with the window (1.0 = 24 min)."""
    from gputopo.contract import DEFAULT_KEYS as K

    rng = random.Random(seed)
    counts = {"train": 7, "experiment": 3, "single": 10, "inference": 12, "notebook": 8}
    works: list[Work] = []

    def when() -> float:
        while True:  # rejection sampling from the day's shape
            x = rng.random()
            if rng.random() * 1.35 <= _rate_shape(x):
                return x * window_s

    def dur(lo: float, hi: float) -> float:
        return round(rng.uniform(lo, hi) * scale, 1)

    for _ in range(counts["train"]):
        size, k = rng.choice((2, 2, 3, 4)), rng.choice((4, 8, 8))
        wid = len(works)
        job = f"train-{wid}"
        pods = tuple(PodSpec(f"{job}-worker-{i}", "train", k,
                             {K.require_nvlink: "true", K.job_size: str(size)},
                             {"training.kubeflow.org/job-name": job, "training.kubeflow.org/replica-index": str(i)})
                     for i in range(size))
        works.append(Work(wid, when(), "train", (pods,), dur(180, 360), gap=2.0))
    for _ in range(counts["experiment"]):
        wid = len(works)
        waves = tuple(tuple(PodSpec(f"exp-{wid}-w{w}-trial-{i}", "trial", 1) for i in range(rng.randint(4, 6)))
                      for w in range(rng.randint(2, 3)))
        works.append(Work(wid, when(), "experiment", waves, dur(60, 120)))
    for _ in range(counts["single"]):
        wid = len(works)
        k = rng.choice((2, 4, 4, 8))
        ask = rng.random()
        notes = ({K.require_nvlink: "true"} if ask < 0.4 else
                 {K.min_gbps: "100"} if ask < 0.6 else {})
        works.append(Work(wid, when(), "single", ((PodSpec(f"single-{wid}", "single", k, notes),),), dur(120, 300)))
    for _ in range(counts["inference"]):
        wid = len(works)
        works.append(Work(wid, when(), "inference", ((PodSpec(f"infer-{wid}", "inference", 1, shared=True),),),
                          dur(240, 600)))
    for _ in range(counts["notebook"]):
        wid = len(works)
        works.append(Work(wid, when(), "notebook", ((PodSpec(f"nb-{wid}", "notebook", 1),),), dur(240, 600)))
    works.sort(key=lambda w: (w.arrival, w.id))
    return works


def pod_object(spec: PodSpec, policy: str) -> dict[str, Any]:
    """The pod as its owner creates it: no schedulerName (the webhook sets ours where it runs), GPUs, and CPU and
    memory in proportion."""
    resource = SHARED if spec.shared else GPU
    cpu = 1 if spec.shared else CPU_PER_GPU * spec.gpus
    mem = 8 if spec.shared else MEM_PER_GPU_GI * spec.gpus
    limits = {resource: str(spec.gpus)}
    requests = {"cpu": str(cpu), "memory": f"{mem}Gi", **limits}
    return {"metadata": {"name": spec.name, "labels": {"bench/kind": spec.kind, **spec.labels},
                         "annotations": dict(spec.annotations)},
            "spec": {"terminationGracePeriodSeconds": 0, "containers": [{
                "name": "work", "image": "registry.invalid/none:0",
                "resources": {"limits": limits, "requests": requests}}]}}


# -- one policy's cluster --------------------------------------------------------------------------------------------


@dataclass
class PodRecord:
    spec: PodSpec
    work: int
    created: float
    uid: str = ""
    bound: float | None = None
    node: str | None = None
    gbps: float | None = None
    need_met: bool | None = None  # for a pod asking NVLink or a floor: whether its GPUs meet it
    failed: bool = False
    deleted: bool = False


@dataclass
class Outcome:
    policy: str
    pods: dict[str, PodRecord] = field(default_factory=dict)
    node_seconds: dict[str, float] = field(default_factory=dict)
    added: dict[str, int] = field(default_factory=dict)
    removed: dict[str, int] = field(default_factory=dict)
    series: list[tuple[float, int, int]] = field(default_factory=list)  # (t, nodes, pending pods)
    jobs: dict[int, float] = field(default_factory=dict)  # train job -> first created to last bound, s
    believed_fit: dict[str, str] = field(default_factory=dict)  # pod -> the existing node CA named
    drained_s: float | None = None  # when the last pod had ended and the last node was gone
    errors: list[str] = field(default_factory=list)


def scheduler_profiles(policy: str) -> list[dict[str, Any]]:
    profile: dict[str, Any] = {"schedulerName": "default-scheduler", "percentageOfNodesToScore": 100}
    if policy == "most-allocated":
        profile["pluginConfig"] = [{"name": "NodeResourcesFit", "args": {"scoringStrategy": {
            "type": "MostAllocated", "resources": [{"name": GPU, "weight": 1}, {"name": SHARED, "weight": 1}]}}}]
    return [profile]


# CA 1.31's hinting simulator logs "Pod NS/NAME can be moved to NODE"; older releases "Pod NS.NAME marked as
# unschedulable can be scheduled on node NODE. Ignoring in scale up."
BELIEVED = re.compile(r"Pod (?P<ns>[a-z0-9-]+)[./](?P<pod>[a-z0-9.-]+?)(?: can be moved to | marked as unschedulable "
                      r"can be scheduled on node )(?P<node>[^\s.]+(?:\.[^\s.]+)*?)(?:\.? |\.?$| \()", re.M)


def believed_fits(ca_log: str, namespace: str = NS) -> dict[str, str]:
    """Pod -> the existing node CA's log says it can be scheduled on (not a template or upcoming node)."""
    out: dict[str, str] = {}
    for m in BELIEVED.finditer(ca_log):
        if m["ns"] == namespace and not m["node"].startswith("template-node-for-"):
            out.setdefault(m["pod"], m["node"])
    return out


class PolicyRun:
    """One policy's cluster and the loop that plays the day on it."""

    def __init__(self, policy: str, works: Sequence[Work], total_s: float, binary: Path, shared_config: Path,
                 unneeded: str, keep_logs: Path | None = None, drain_cap_s: float = 900.0) -> None:
        self.policy = policy
        self.drain_cap_s = drain_cap_s
        self.keep_logs = keep_logs
        self.works = works
        self.total_s = total_s
        self.binary = binary
        self.shared_config = shared_config
        self.unneeded = unneeded
        self.out = Outcome(policy)
        self.ready = threading.Event()
        self.go = threading.Event()
        self.t0 = 0.0

    def groups(self) -> list[Any]:
        from sim.ca_provider import NodeGroupSpec

        return [NodeGroupSpec(g.id, TOPOLOGIES / f"{g.fixture}.txt", 0, g.max_size, gpu_type=g.gpu_type,
                              sharing_config=self.shared_config if g.shared else None, gpu_label=not g.shared)
                for g in GROUPS]

    @contextlib.contextmanager
    def cluster(self) -> Iterator[tuple[Any, Any]]:
        from tests.helpers.autoscaler import running_autoscaler
        from tests.helpers.chart_install import install_chart
        from tests.helpers.controlplane import ControlPlane

        with ControlPlane() as cp:
            cp.ensure_namespace(NS)
            if self.policy == "ours":
                install_chart(cp)
            else:
                cp.start_scheduler(extra_config={"profiles": scheduler_profiles(self.policy)})
            # the plugin's own PodResources interval (the tests' 0.5 s would cost the shared cores with ~40 plugins)
            plugin_args = {g.id: ("--pod-resources-poll-interval", "10") for g in GROUPS}
            with running_autoscaler(cp, self.binary, self.groups(), expander="least-waste",
                                    unneeded=self.unneeded, plugin_args=plugin_args,
                                    extra=("--scan-interval=10s", "--max-node-provision-time=5m")) as ca:
                try:
                    yield cp, ca
                finally:
                    if self.keep_logs is not None:
                        dest = self.keep_logs / self.policy
                        dest.mkdir(parents=True, exist_ok=True)
                        for log in cp.dir.glob("*.log"):
                            shutil.copy(log, dest / log.name)

    def run(self) -> None:
        try:
            with self.cluster() as (cp, ca):
                self.ready.set()
                self.go.wait()
                self._play(cp, ca)
                self.out.believed_fit = believed_fits(ca.log())
                self.out.errors.extend(ca.provider.errors)
        except Exception as e:  # reported in the results, the other policies go on
            self.out.errors.append(f"{type(e).__name__}: {e}")
            self.ready.set()

    # -- the day ---------------------------------------------------------------------------------------------------

    def _play(self, cp: Any, ca: Any) -> None:
        from gputopo.discovery.loader import load_topology_file

        topologies = {g.id: load_topology_file(TOPOLOGIES / f"{g.fixture}.txt") for g in GROUPS}
        due: list[tuple[float, int, str, int, int]] = []  # (t, order, what, work id, wave)
        order = 0
        for w in self.works:
            heapq.heappush(due, (w.arrival, order, "wave", w.id, 0))
            order += 1
        by_id = {w.id: w for w in self.works}
        wave_pods: dict[tuple[int, int], list[str]] = {}
        wave_end: dict[tuple[int, int], float] = {}
        members_before: dict[str, set[str]] = {g.id: set() for g in GROUPS}
        last_sample = -1.0
        self.t0 = time.monotonic()
        while True:
            now = time.monotonic() - self.t0
            if now >= self.total_s:
                # the day's work done and every node gone (or the cap): node-hours count the whole of it
                live = any(not r.deleted for r in self.out.pods.values()) or due or wave_pods
                if not live and not any(ca.provider.members(g.id) for g in GROUPS):
                    self.out.drained_s = now
                    break
                if now >= self.total_s + self.drain_cap_s:
                    break
            while due and due[0][0] <= now:
                _, _, what, wid, wave = heapq.heappop(due)
                work = by_id[wid]
                if what == "wave":
                    pods = work.waves[wave]
                    wave_pods[(wid, wave)] = [p.name for p in pods]
                    for i, spec in enumerate(pods):
                        heapq.heappush(due, (now + i * work.gap, order, f"pod:{spec.name}", wid, wave))
                        order += 1
                elif what.startswith("pod:"):
                    spec = next(p for p in work.waves[wave] if p.name == what[4:])
                    self._create(cp, spec, wid, now)
            self._observe(cp, ca, topologies, now)
            for key, names in list(wave_pods.items()):
                recs = [self.out.pods.get(n) for n in names]
                if any(r is None or r.bound is None for r in recs):
                    continue
                if key not in wave_end:
                    wid, wave = key
                    wave_end[key] = max(r.bound for r in recs if r and r.bound is not None) + by_id[wid].duration
                    if by_id[wid].kind == "train":
                        first = min(r.created for r in recs if r)
                        self.out.jobs[wid] = max(r.bound for r in recs if r and r.bound is not None) - first
                if now >= wave_end[key]:
                    for n in names:
                        self._delete(cp, n)
                    del wave_pods[key]
                    wid, wave = key
                    if wave + 1 < len(by_id[wid].waves):
                        heapq.heappush(due, (now, order, "wave", wid, wave + 1))
                        order += 1
            if now - last_sample >= 2.0:
                self._sample(ca, now, now - last_sample if last_sample >= 0 else 0.0, members_before)
                last_sample = now
            time.sleep(0.5)

    def _create(self, cp: Any, spec: PodSpec, wid: int, now: float) -> None:
        self.out.pods[spec.name] = PodRecord(spec, wid, now)
        try:
            got = cp.request("POST", f"/api/v1/namespaces/{NS}/pods", pod_object(spec, self.policy))
            self.out.pods[spec.name].uid = got["metadata"]["uid"]
        except Exception as e:
            self.out.errors.append(f"create {spec.name}: {e}")

    def _delete(self, cp: Any, name: str) -> None:
        rec = self.out.pods.get(name)
        if rec is None or rec.deleted:
            return
        rec.deleted = True
        with contextlib.suppress(Exception):
            cp.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{name}", ok=(200, 202, 404), gracePeriodSeconds=0)

    def _observe(self, cp: Any, ca: Any, topologies: Mapping[str, Any], now: float) -> None:
        from gputopo.core import allreduce_gbps

        try:
            pods = cp.list_items(f"/api/v1/namespaces/{NS}/pods")
        except Exception as e:
            self.out.errors.append(f"list pods: {e}")
            return
        nodes = ca.provider.started_nodes()
        for pod in pods:
            rec = self.out.pods.get(pod["metadata"]["name"])
            if rec is None:
                continue
            node = pod["spec"].get("nodeName")
            if node and rec.bound is None:
                rec.bound, rec.node = now, node
            if (pod.get("status") or {}).get("phase") == "Failed" and not rec.failed:
                rec.failed = True  # admission refused it: the owner would make a new one; counted, not remade
            if node and rec.gbps is None and rec.spec.gpus > 1 and not rec.spec.shared:
                admitted = getattr(getattr(nodes.get(node), "admission", None), "admitted", {}).get(rec.uid)
                if admitted is not None:
                    topo = topologies[node.rpartition("-")[0]]
                    ids = {d for per in admitted.devices.values() for d in per.get(GPU, [])}
                    rec.gbps = allreduce_gbps(topo, [g.index for g in topo.gpus if g.id in ids])
                    rec.need_met = need_met(rec.spec, topo, rec.gbps)

    def _sample(self, ca: Any, now: float, dt: float, before: dict[str, set[str]]) -> None:
        total = 0
        for g in GROUPS:
            members = set(ca.provider.members(g.id))
            self.out.node_seconds[g.id] = self.out.node_seconds.get(g.id, 0.0) + dt * len(before[g.id])
            self.out.added[g.id] = self.out.added.get(g.id, 0) + len(members - before[g.id])
            self.out.removed[g.id] = self.out.removed.get(g.id, 0) + len(before[g.id] - members)
            before[g.id] = members
            total += len(members)
        pending = sum(1 for r in self.out.pods.values() if r.bound is None and not r.deleted)
        self.out.series.append((round(now, 1), total, pending))


def need_met(spec: PodSpec, topo: Any, gbps: float) -> bool | None:
    """Whether a pod's GPUs meet what it asked (the extender's own tests: a ring at the node's slowest NVLink pair
    for require-nvlink, the floor for min-allreduce-gbps); None for a pod that asked neither."""
    from gputopo.contract import DEFAULT_KEYS as K
    from gputopo.core import min_nvlink_gbps

    asked = False
    met = True
    if spec.annotations.get(K.require_nvlink) == "true":
        asked = True
        floor = min_nvlink_gbps(topo)
        met = met and floor is not None and gbps + 1e-9 >= floor
    if (floor_gbps := spec.annotations.get(K.min_gbps)) is not None:
        asked = True
        met = met and gbps + 1e-9 >= float(floor_gbps)
    return met if asked else None


# -- the report ------------------------------------------------------------------------------------------------------


def summary(out: Outcome, total_s: float) -> dict[str, Any]:
    pods = list(out.pods.values())
    pending: dict[str, list[float]] = {k: [] for k in KINDS}
    for r in pods:
        if r.bound is not None:
            pending[r.spec.kind].append(r.bound - r.created)
    never = [r.spec.name for r in pods if r.bound is None]
    multi = [r.gbps for r in pods if r.gbps is not None]
    nvlink_asked = [r.gbps for r in pods if r.gbps is not None and r.spec.annotations]
    waited = {p: n for p, n in out.believed_fit.items()
              if (r := out.pods.get(p)) is not None and (r.bound is None or r.bound - r.created > 60)}
    return {
        "policy": out.policy,
        "gpu_node_hours": round(sum(out.node_seconds.values()) / 3600, 3),
        "node_hours_by_group": {g: round(s / 3600, 3) for g, s in out.node_seconds.items()},
        "nodes_added": sum(out.added.values()), "nodes_removed": sum(out.removed.values()),
        "added_by_group": out.added,
        "pending_s": {k: {"pods": len(v), "p50": round(percentile(v, 50), 1) if v else None,
                          "p95": round(percentile(v, 95), 1) if v else None} for k, v in pending.items()},
        "job_bound_s": {"jobs": len(out.jobs), "p50": round(percentile(list(out.jobs.values()), 50), 1)
                        if out.jobs else None,
                        "p95": round(percentile(list(out.jobs.values()), 95), 1) if out.jobs else None},
        "allreduce_gbps_mean": round(statistics.fmean(multi), 1) if multi else None,
        "allreduce_gbps_mean_asked": round(statistics.fmean(nvlink_asked), 1) if nvlink_asked else None,
        "multi_gpu_pods_measured": len(multi),
        "needs_unmet": sorted(r.spec.name for r in pods if r.need_met is False),
        "needs_measured": sum(1 for r in pods if r.need_met is not None),
        "max_nodes": max((s[1] for s in out.series), default=0), "drained_s": out.drained_s,
        "pods": len(pods), "never_bound": never, "failed_admission": [r.spec.name for r in pods if r.failed],
        "believed_fit": out.believed_fit, "waited_while_ca_believed_fit": waited,
        "errors": out.errors[:20], "run_s": total_s,
    }


def _f(v: object) -> str:
    return "-" if v is None else str(v)


def tables(results: Sequence[Mapping[str, Any]]) -> str:
    main = markdown_table(
        ["policy", "GPU node-hours", "nodes added / removed (most at once)", "drained at s",
         "all-reduce GB/s, multi-GPU pods (those asking)", "pods whose NVLink / GB/s ask was not met",
         "training job bound p50 / p95 s", "never bound", "failed admission", "waited while CA believed it fits"],
        [[r["policy"], r["gpu_node_hours"], f"{r['nodes_added']} / {r['nodes_removed']} ({r['max_nodes']})",
          _f(r["drained_s"] and round(r["drained_s"])),
          f"{_f(r['allreduce_gbps_mean'])} ({_f(r['allreduce_gbps_mean_asked'])})",
          f"{len(r['needs_unmet'])} of {r['needs_measured']}",
          f"{_f(r['job_bound_s']['p50'])} / {_f(r['job_bound_s']['p95'])}", len(r["never_bound"]),
          len(r["failed_admission"]), len(r["waited_while_ca_believed_fit"])] for r in results])
    kinds = markdown_table(
        ["policy", *[f"{k} p50 / p95 s" for k in KINDS]],
        [[r["policy"], *[f"{_f(r['pending_s'][k]['p50'])} / {_f(r['pending_s'][k]['p95'])}" for k in KINDS]]
         for r in results])
    groups = markdown_table(
        ["policy", *[f"{g.id} node-h (added)" for g in GROUPS]],
        [[r["policy"], *[f"{r['node_hours_by_group'].get(g.id, 0)} ({r['added_by_group'].get(g.id, 0)})"
                         for g in GROUPS]] for r in results])
    return f"{main}\n\nPending time, creation to bound, per workload kind:\n\n{kinds}\n\nPer node group:\n\n{groups}"


def plot(outcomes: Sequence[Outcome], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for out in outcomes:
        if not out.series:
            continue
        t = [s[0] / 60 for s in out.series]
        axes[0].plot(t, [s[1] for s in out.series], label=out.policy)
        axes[1].plot(t, [s[2] for s in out.series], label=out.policy)
    axes[0].set_ylabel("GPU nodes (asked, up, going)")
    axes[1].set_ylabel("pending pods")
    axes[1].set_xlabel("minutes into the compressed day")
    axes[0].set_title("Real Cluster Autoscaler 1.31.5: nodes and pending pods per policy")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=24.0, help="length of the compressed day")
    parser.add_argument("--seed", type=int, default=20261207)
    parser.add_argument("--unneeded", default="60s", help="CA's --scale-down-unneeded-time")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--quick", action="store_true", help="a 6-minute day with short work (a smoke run)")
    parser.add_argument("--out", type=Path, default=RESULTS / "autoscale-real")
    parser.add_argument("--keep-logs", type=Path, default=None, help="copy each policy's component logs here")
    args = parser.parse_args(argv)
    from tests.helpers.autoscaler import skip_reason, unpack

    if (why := skip_reason()) is not None:
        sys.exit(f"cannot run: {why}")
    minutes = 6.0 if args.quick else args.minutes
    total_s = minutes * 60
    works = trace(args.seed, total_s * 0.7, scale=minutes / 24.0)
    policies = [p for p in args.policies.split(",") if p]
    with tempfile.TemporaryDirectory(prefix="autoscale-real-") as tmp:
        binary = unpack(Path(tmp))
        shared_config = Path(tmp) / "time-slicing.yaml"
        shared_config.write_text(RENAMED_TIME_SLICING)
        runs = [PolicyRun(p, works, total_s, binary, shared_config, args.unneeded, args.keep_logs) for p in policies]
        threads = [threading.Thread(target=r.run, name=f"policy-{r.policy}", daemon=True) for r in runs]
        load_before = _load()
        for th in threads:
            th.start()
        for r in runs:
            r.ready.wait(300)
        for r in runs:
            r.go.set()  # the day starts at once on every cluster
        loads: list[float] = []
        while any(th.is_alive() for th in threads):
            loads.append(_load())
            for th in threads:
                th.join(timeout=30 / max(1, len(threads)))
    results = [summary(r.out, total_s) for r in runs]
    head = (f"{machine_line()} Command: `python -m bench.autoscale_real --minutes {minutes:g} --seed {args.seed}`. "
            f"Three control planes side by side; 1-minute load average {load_before:.2f} before, median "
            f"{statistics.median(loads) if loads else 0:.2f} and max {max(loads, default=0):.2f} during the run. "
            f"{len(works)} arrivals, {sum(len(p) for w in works for p in w.waves)} pods.")
    text = f"{head}\n\n{tables(results)}\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(f"# Autoscaling with the real Cluster Autoscaler\n\n{text}")
    args.out.with_suffix(".json").write_text(json.dumps({"head": head, "results": results}, indent=1))
    plot([r.out for r in runs], args.out.with_suffix(".png"))


def _load() -> float:
    import os

    return os.getloadavg()[0]


if __name__ == "__main__":
    main()
