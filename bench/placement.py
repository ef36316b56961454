"""Cluster churn, topology-aware vs topology-blind placement: `python -m bench.placement [--hours H] [--seed S]`.

A seeded discrete-event simulation: jobs arrive (Poisson), ask for 1, 2, 4 or 8 GPUs on one node, run for a
lognormal time and leave. The offered load keeps GPU utilisation above 70 %, so fragmentation happens.
Pending jobs are retried in arrival order after every arrival and departure, without head-of-line blocking, as
kube-scheduler does.

Policies:
  (a) blind + random:  kube-scheduler's default node choice (NodeResourcesFit LeastAllocated: the feasible node
      with the most free GPUs, ties at random) and the kubelet's device choice without a preference (random).
  (b) blind + kubelet best: the same node choice, then the best subset at the kubelet (what NVIDIA's plugin does).
  (c) this project: the extender's filter and prioritize decide the node (kube-scheduler's LeastAllocated only
      breaks the extender's ties, its weight being far below the extender's), the plan is the extender's subset,
      and the plugin honours it.

Two clusters are reported separately: (1) >= 100 servers where the wiring differs inside a node (8x V100 hybrid
cube-mesh, PCIe servers with NVLink bridge pairs, PCIe-only two-socket servers), all from the shared real
`nvidia-smi topo -m` fixtures; (2) a mixed fleet that adds NVSwitch servers (p4d, p5, DGX A100 fixtures).
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench.common import RESULTS, SHARED, machine_line, markdown_table
from gputopo.core import VS_EMPTY, Topology, allreduce_gbps, best_subset, efficiency_vs_empty
from gputopo.discovery.loader import load_topology_file

SIZES = (1, 2, 4, 8)
SIZE_WEIGHTS = (0.3, 0.3, 0.25, 0.15)
POLICIES = ("a: blind + random", "b: blind + kubelet best", "c: extender + plans")

CLUSTER_1 = {
    "dgx1-v100-ucxpy": 40,
    "pcie-8x-rtxa6000-nvlinkbridge-pairs-2socket-unige-baobab": 30,
    "pcie-8x-a100-nv12-bridge-pairs-2socket-nccltests178": 20,
    "pcie-8x-rtx5090-2socket-sglang23020": 30,
}
CLUSTER_2 = {
    "dgx1-v100-ucxpy": 20,
    "pcie-8x-rtxa6000-nvlinkbridge-pairs-2socket-unige-baobab": 15,
    "pcie-8x-a100-nv12-bridge-pairs-2socket-nccltests178": 10,
    "pcie-8x-rtx5090-2socket-sglang23020": 15,
    "aws-p4d.24xlarge": 20,
    "aws-p5.48xlarge": 20,
    "dgx-a100-8gpu-10nic-1mcprddgx05": 20,
}


@dataclass
class Node:
    name: str
    kind: str
    topo: Topology
    free: set[int]


@dataclass(frozen=True)
class Job:
    id: int
    arrival: float
    size: int
    duration: float


@dataclass
class Outcome:
    placed: list[tuple[Job, Node, tuple[int, ...], float, float, bool, bool]] = field(default_factory=list)
    frag_jobs: set[int] = field(default_factory=set)
    frag_wait_s: float = 0.0
    busy_gpu_s: float = 0.0
    window_s: float = 0.0
    gpus: int = 0


def trace(seed: int, hours: float, gpus: int, load: float) -> list[Job]:
    """Poisson arrivals at the rate that offers `load` x the cluster's GPU-seconds."""
    rng = random.Random(seed)
    mean_size = sum(s * w for s, w in zip(SIZES, SIZE_WEIGHTS, strict=True))
    mean_duration = 3600.0
    sigma = 0.8
    rate = load * gpus / (mean_size * mean_duration)
    jobs, t = [], 0.0
    while t < hours * 3600:
        t += rng.expovariate(rate)
        size = rng.choices(SIZES, SIZE_WEIGHTS)[0]
        duration = rng.lognormvariate(math.log(mean_duration) - sigma**2 / 2, sigma)
        jobs.append(Job(len(jobs), t, size, duration))
    return jobs


def least_allocated(nodes: Sequence[Node], job: Job, rng: random.Random) -> Node | None:
    """kube-scheduler's default NodeResourcesFit score: most free capacity, ties broken at random."""
    feasible = [n for n in nodes if len(n.free) >= job.size]
    if not feasible:
        return None
    top = max(len(n.free) / n.topo.size for n in feasible)
    return rng.choice([n for n in feasible if len(n.free) / n.topo.size == top])


def policy_a(nodes: Sequence[Node], job: Job, rng: random.Random) -> tuple[Node, tuple[int, ...]] | None:
    node = least_allocated(nodes, job, rng)
    if node is None:
        return None
    return node, tuple(sorted(rng.sample(sorted(node.free), job.size)))


def policy_b(nodes: Sequence[Node], job: Job, rng: random.Random) -> tuple[Node, tuple[int, ...]] | None:
    node = least_allocated(nodes, job, rng)
    if node is None:
        return None
    return node, best_subset(node.topo, node.free, job.size).gpus


class ExtenderPolicy:
    """Policy (c): the extender's own filter, prioritize and bind choice (extender.placement.engine), fed the cluster's
    free GPUs as the node cache would hold them; kube-scheduler's LeastAllocated breaks the extender's ties."""

    def __init__(self, **config_options: float) -> None:
        from extender.config import ExtenderConfig
        from extender.placement.engine import Placement
        from extender.state.cache import NodeCache
        from extender.state.reservations import Reservations

        config = ExtenderConfig(**config_options)
        self.cache = NodeCache(config, Reservations(config.reservation_timeout_s))
        self.placement = Placement(self.cache)
        self._seen: dict[str, frozenset[int]] = {}

    def _sync(self, nodes: Sequence[Node]) -> None:
        from extender.state.cache import make_entry

        for n in nodes:
            free = frozenset(n.free)
            if self._seen.get(n.name) != free:
                used = [g.id for g in n.topo.gpus if g.index not in free]
                self.cache.put_node(make_entry(n.name, n.topo, used=used))
                self._seen[n.name] = free

    def __call__(self, nodes: Sequence[Node], job: Job, rng: random.Random) -> tuple[Node, tuple[int, ...]] | None:
        from extender.state.pods import Need

        self._sync(nodes)
        need = Need(job.size)
        by_name = {n.name: n for n in nodes}
        passed = self.placement.filter(list(by_name), need).passed
        if not passed:
            return None
        # kube-scheduler skips prioritize when one node is left
        scores = dict(zip(passed, self.placement.score(passed, need), strict=True)) if len(passed) > 1 else {}
        scores = scores or {passed[0]: 0}
        top = max(scores.values())
        tied = [by_name[name] for name in passed if scores[name] == top]
        most = max(len(n.free) / n.topo.size for n in tied)
        node = rng.choice([n for n in tied if len(n.free) / n.topo.size == most])
        entry = self.cache.nodes[node.name]
        alloc = self.placement.choose(entry, self.cache.free_mask(entry), need)
        return node, alloc.gpus


PolicyFn = Callable[[Sequence[Node], Job, random.Random], tuple[Node, tuple[int, ...]] | None]


_MIN_NVLINK_MBPS: dict[str, int | None] = {}


def nvlink_ring(topo: Topology, gpus: Sequence[int]) -> bool:
    """Whether the subset's best ring runs on NVLink alone (its bottleneck is an NVLink-class estimate)."""
    if len(gpus) < 2:
        return False
    if topo.fingerprint not in _MIN_NVLINK_MBPS:  # once per machine kind, not per placement
        nv = [topo.bandwidth_mbps[i][j] for i in range(topo.size) for j in range(topo.size)
              if i != j and topo.link(i, j).kind.is_nvlink]
        _MIN_NVLINK_MBPS[topo.fingerprint] = min(nv) if nv else None
    floor = _MIN_NVLINK_MBPS[topo.fingerprint]
    return floor is not None and allreduce_gbps(topo, gpus) * 1000 >= floor


def simulate(cluster: dict[str, int], policy: PolicyFn, jobs: Sequence[Job], seed: int) -> Outcome:
    topos = {kind: load_topology_file(SHARED / "topologies" / f"{kind}.txt") for kind in cluster}
    nodes = [
        Node(f"{kind}-{k:03d}", kind, topos[kind], set(range(topos[kind].size)))
        for kind, count in cluster.items()
        for k in range(count)
    ]
    rng = random.Random(seed)
    out = Outcome(gpus=sum(n.topo.size for n in nodes))
    events: list[tuple[float, int, int, Job, Node | None, tuple[int, ...]]] = []
    for job in jobs:
        heapq.heappush(events, (job.arrival, 1, job.id, job, None, ()))
    pending: list[Job] = []
    busy = 0
    now = 0.0
    # Utilisation is measured in the steady window: after a warm-up tenth, until the last arrival (not the drain).
    w_start, w_end = 0.1 * jobs[-1].arrival, jobs[-1].arrival
    free_total = out.gpus
    while events:
        t, kind, _, job, node, gpus = heapq.heappop(events)
        dt = t - now
        overlap = max(0.0, min(t, w_end) - max(now, w_start))
        out.busy_gpu_s += busy * overlap
        out.frag_wait_s += dt * sum(1 for p in pending if p.size <= free_total)
        now = t
        if kind == 0:  # departure
            assert node is not None
            node.free.update(gpus)
            busy -= len(gpus)
            free_total += len(gpus)
        else:
            pending.append(job)
        still = []
        for p in pending:
            choice = policy(nodes, p, rng)
            if choice is None:
                if p.size <= free_total:
                    out.frag_jobs.add(p.id)
                still.append(p)
                continue
            n, chosen = choice
            assert len(chosen) == p.size and set(chosen) <= n.free
            free_before = frozenset(n.free)
            could_nvlink = p.size >= 2 and nvlink_ring(n.topo, best_subset(n.topo, free_before, p.size).gpus)
            n.free.difference_update(chosen)
            busy += p.size
            free_total -= p.size
            gbps = allreduce_gbps(n.topo, chosen)
            eff = efficiency_vs_empty(n.topo, chosen)
            out.placed.append((p, n, chosen, gbps, eff, could_nvlink, nvlink_ring(n.topo, chosen)))
            heapq.heappush(events, (now + p.duration, 0, p.id, p, n, chosen))
        pending = still
    out.window_s = w_end - w_start
    return out


@dataclass
class Summary:
    efficiency: float
    nvlink_share: float
    nvlink_of: str
    gbps: float
    frag_jobs: int
    frag_wait_h: float
    utilisation: float
    jobs: int
    by_size: dict[int, tuple[float, float, int]]


def summarise(out: Outcome) -> Summary:
    multi = [p for p in out.placed if p[0].size >= 2]
    could = [p for p in multi if p[5]]
    by_size: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for p in multi:
        by_size[p[0].size].append((p[4], p[3]))
    return Summary(
        efficiency=statistics.fmean(p[4] for p in multi),
        nvlink_share=sum(1 for p in could if p[6]) / len(could) if could else math.nan,
        nvlink_of=f"{sum(1 for p in could if p[6])}/{len(could)}",
        gbps=statistics.fmean(p[3] for p in multi),
        frag_jobs=len(out.frag_jobs),
        frag_wait_h=out.frag_wait_s / 3600,
        utilisation=out.busy_gpu_s / (out.gpus * out.window_s),
        jobs=len(out.placed),
        by_size={
            s: (statistics.fmean(e for e, _ in v), statistics.fmean(g for _, g in v), len(v))
            for s, v in sorted(by_size.items())
        },
    )


def plot(results: dict[str, dict[str, Summary]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [
        ("mean all-reduce GB/s per multi-GPU job", lambda s: s.gbps),
        (f"mean {VS_EMPTY}", lambda s: s.efficiency),
        ("NVLink-ring share (when possible)", lambda s: s.nvlink_share),
        ("jobs that waited on fragmentation", lambda s: s.frag_jobs),
    ]
    fig, axes = plt.subplots(len(results), len(metrics), figsize=(16, 3.6 * len(results)), squeeze=False)
    colours = ["#c44e52", "#dd8452", "#4c72b0"]
    for row, (cluster, by_policy) in enumerate(results.items()):
        for col, (title, get) in enumerate(metrics):
            ax = axes[row][col]
            vals = [get(by_policy[p]) for p in POLICIES]
            ax.bar(range(len(POLICIES)), vals, color=colours)
            ax.set_xticks(range(len(POLICIES)))
            ax.set_xticklabels([p.split(":")[0] for p in POLICIES])
            ax.set_title(f"{cluster}\n{title}", fontsize=9)
            for x, v in enumerate(vals):
                label = f"{v:.2f}" if isinstance(v, float) else str(v)
                ax.annotate(label, (x, v), ha="center", va="bottom", fontsize=8)
    fig.suptitle("Cluster churn: (a) blind + random, (b) blind + kubelet best subset, (c) extender + plans")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_sizes(results: dict[str, dict[str, Summary]], path: str) -> None:
    """Mean estimated all-reduce GB/s per request size: where the cluster-wide gain comes from, and what it costs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 4), squeeze=False)
    colours = ["#c44e52", "#dd8452", "#4c72b0"]
    for col, (cluster, by_policy) in enumerate(results.items()):
        ax = axes[0][col]
        for k, policy in enumerate(POLICIES):
            sizes = sorted(by_policy[policy].by_size)
            vals = [by_policy[policy].by_size[s][1] for s in sizes]
            ax.bar([i + (k - 1) * 0.27 for i in range(len(sizes))], vals, width=0.27, color=colours[k],
                   label=policy)
            for i, v in enumerate(vals):
                ax.annotate(f"{v:.0f}", (i + (k - 1) * 0.27, v), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(sizes)))
        ax.set_xticklabels([f"{s} GPUs" for s in sizes])
        ax.set_ylabel("mean estimated all-reduce GB/s")
        ax.set_title(cluster, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=24.0, help="simulated time (default 24)")
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--load", type=float, default=0.95, help="offered load as a share of GPU capacity")
    args = parser.parse_args()
    started = time.time()
    fns: dict[str, Callable[[], PolicyFn]] = dict(
        zip(POLICIES, (lambda: policy_a, lambda: policy_b, ExtenderPolicy), strict=True)
    )
    results: dict[str, dict[str, Summary]] = {}
    text = [
        "# Placement under cluster churn\n",
        f"`python -m bench.placement --hours {args.hours:g} --seed {args.seed} --load {args.load:g}` "
        f"on {machine_line()}.\n",
    ]
    for label, cluster in (("cluster 1 (wiring differs inside nodes)", CLUSTER_1),
                           ("cluster 2 (mixed fleet with NVSwitch)", CLUSTER_2)):
        gpus = 8 * sum(cluster.values())
        jobs = trace(args.seed, args.hours, gpus, args.load)
        results[label] = {}
        for name, fn in fns.items():
            t0 = time.time()
            results[label][name] = summarise(simulate(cluster, fn(), jobs, args.seed))
            print(f"  {label}: {name} done in {time.time() - t0:.1f} s", flush=True)
        by = results[label]
        nodes = ", ".join(f"{v}x {k}" for k, v in cluster.items())
        rows = [
            [name, s.jobs, f"{s.gbps:.1f}", f"{s.efficiency:.3f}", f"{s.nvlink_share:.3f} ({s.nvlink_of})",
             s.frag_jobs, f"{s.frag_wait_h:.1f}", f"{s.utilisation:.3f}"]
            for name, s in by.items()
        ]
        size_rows = [
            [name, *[f"{s.by_size[k][1]:.1f} GB/s, eff {s.by_size[k][0]:.3f}" for k in (2, 4, 8)]]
            for name, s in by.items()
        ]
        a, b, c = (by[p] for p in POLICIES)
        text += [
            f"\n## {label}\n\n{sum(cluster.values())} servers, {gpus} GPUs: {nodes}. {len(jobs)} jobs.\n",
            markdown_table(["policy", "jobs placed", "mean all-reduce GB/s (multi-GPU)", f"mean {VS_EMPTY}",
                            "NVLink ring when possible", "jobs that waited on fragmentation",
                            "job-hours waited on fragmentation", "GPU utilisation"], rows),
            f"\nPer request size (mean estimated all-reduce GB/s, mean {VS_EMPTY}):\n",
            markdown_table(["policy", "2 GPUs", "4 GPUs", "8 GPUs"], size_rows),
            f"\n(c) / (a) mean all-reduce: {c.gbps / a.gbps:.2f}x; (c) / (b): {c.gbps / b.gbps:.2f}x; "
            f"fragmentation waits (c) {c.frag_jobs} vs (b) {b.frag_jobs}.\n",
        ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(results, str(RESULTS / "placement.png"))
    plot_sizes(results, str(RESULTS / "placement-sizes.png"))
    text.append(f"\n![placement](placement.png)\n\n![per size](placement-sizes.png)\n\n"
                f"Run time {time.time() - started:.0f} s.\n")
    (RESULTS / "placement.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
