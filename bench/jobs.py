"""Jobs of many pods under cluster churn, and job planning latency: `python -m bench.jobs [--hours H] [--seed S]`.

The churn of bench/placement.py (seeded Poisson arrivals, lognormal durations, pending jobs retried in arrival order
after every arrival and departure, no head-of-line blocking), with multi-pod jobs (2-32 pods of 1-8 GPUs) mixed
with single-pod jobs, on 128 servers in 16 racks of one machine kind each (4 spines of 4 racks), built from the
shared `nvidia-smi topo -m` fixtures that have NIC rows. Gang admission: a job starts when all its pods are placed
at once (what Kueue, Volcano or coscheduling provide), so no policy leaves a job partly placed here; the
interleaved-creation case of the issue needs the extender's job plans (phase 2) and is not simulated.

NIC line rates (the fixtures name NICs, not rates): DGX-1 V100 100 Gb/s (EDR, fixtures/topologies/SOURCES.md),
HGX A100 deepep13 100 Gb/s (RoCE, SOURCES.md); ASSUMED: GCP A4 B200 400 Gb/s per NIC, DGX A100 200 Gb/s (HDR),
the two PCIe servers 100 Gb/s (bandwidth.DEFAULT_NIC_GBIT). Locality factors: the model's defaults (0.5 per level).

Policies, side by side on the same trace:
  (a) topology-blind: per pod, kube-scheduler's LeastAllocated node and the kubelet's random GPUs.
  (b) today's per-pod extender: per pod, the extender's filter, prioritize and plan (extender.placement.engine).
  (c) rack-level only (the Kueue TAS / KAI shape): the job goes to the smallest domain (rack, spine, cluster) that
      holds it, the fullest such domain first; inside it, pods fill the nodes with the most free GPUs first;
      GPUs per pod by the allocator's best subset (a topology-aware device plugin), not looking at NICs.
  (d) job-aware: extender.jobs.planner for the whole job; single-pod jobs as (b).

Reported per policy: mean and p10 estimated job all-reduce (gputopo.core.jobs) over multi-pod jobs, share of
multi-pod jobs inside one rack, jobs that waited on fragmentation (enough GPUs free in all, no placement),
utilisation. Then the planner's latency for a 32-pod job on 5,000 nodes.
"""

from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from bench.common import RESULTS, SHARED, machine_line, markdown_table, percentile, policy_bars
from bench.placement import ExtenderPolicy, Node, least_allocated
from bench.placement import Job as PodJob
from extender.jobs.planner import JobPlanError, JobRequest, JobUnplaceable, NodeSnapshot, plan_job
from gputopo.core import Topology, best_subset
from gputopo.core.bitset import mask_of
from gputopo.core.jobs import PodSlot, job_allreduce_gbps
from gputopo.core.locality import Level, Locality
from gputopo.core.topology import Nic
from gputopo.discovery.loader import load_topology_file

LOCALITY = Locality((Level("rack", ("example.com/rack",)), Level("spine", ("example.com/spine",))))
# machine kind -> (racks, NIC line rate Gb/s): see the module docstring for which rates are documented
FLEET: dict[str, tuple[int, float]] = {
    "gcp-a4-b200-8gpu-nv18-dranet": (4, 400.0),
    "dgx-a100-8gpu-10nic-1mcprddgx05": (3, 200.0),
    "hgx-a100-sxm4-80gb-8gpu-8nic-deepep13": (3, 100.0),
    "dgx1-v100-ucxpy": (3, 100.0),
    "pcie-8x-rtxa6000-nvlinkbridge-pairs-2socket-unige-baobab": (2, 100.0),
    "pcie-8x-rtx5090-2socket-sglang23020": (1, 100.0),
}
NODES_PER_RACK = 8
RACKS_PER_SPINE = 4
SINGLE_SIZES, SINGLE_WEIGHTS = (1, 2, 4, 8), (0.3, 0.3, 0.25, 0.15)
PODS, PODS_WEIGHTS = (2, 4, 8, 16, 32), (0.35, 0.3, 0.2, 0.1, 0.05)
PER_POD, PER_POD_WEIGHTS = (1, 2, 4, 8), (0.25, 0.25, 0.25, 0.25)
MULTI_SHARE = 0.5
POLICIES = ("a: topology-blind", "b: per-pod extender", "c: rack-level only", "d: job-aware")


@dataclass(frozen=True)
class TrainJob:
    id: int
    arrival: float
    pods: int
    gpus_per_pod: int
    duration: float

    @property
    def gpus(self) -> int:
        return self.pods * self.gpus_per_pod


Placement = list[tuple[Node, tuple[int, ...]]]
PolicyFn = Callable[[Sequence[Node], TrainJob, random.Random], Placement | None]


def with_rate(topo: Topology, gbit: float) -> Topology:
    nics = [Nic(n.name, n.gpu_links, n.rdma, gbit) for n in topo.nics]
    return Topology.build(topo.gpus, topo.links, nics, topo.pcie_generation, topo.socket_link_gbps)


def build_cluster() -> tuple[list[Node], dict[str, tuple[str | None, ...]]]:
    kinds = [kind for kind, (racks, _) in FLEET.items() for _ in range(racks)]
    topos = {kind: with_rate(load_topology_file(SHARED / "topologies" / f"{kind}.txt"), gbit)
             for kind, (_, gbit) in FLEET.items()}
    nodes, places = [], {}
    for r, kind in enumerate(kinds):
        for i in range(NODES_PER_RACK):
            name = f"r{r:02d}-{kind.split('-')[0]}-{i}"
            nodes.append(Node(name, kind, topos[kind], set(range(topos[kind].size))))
            places[name] = (f"r{r:02d}", f"s{r % RACKS_PER_SPINE}")  # each spine gets a mix of kinds
    return nodes, places


def trace(seed: int, hours: float, gpus: int, load: float) -> list[TrainJob]:
    rng = random.Random(seed)
    mean_single = sum(s * w for s, w in zip(SINGLE_SIZES, SINGLE_WEIGHTS, strict=True))
    mean_multi = (sum(p * w for p, w in zip(PODS, PODS_WEIGHTS, strict=True))
                  * sum(k * w for k, w in zip(PER_POD, PER_POD_WEIGHTS, strict=True)))
    mean_gpus = MULTI_SHARE * mean_multi + (1 - MULTI_SHARE) * mean_single
    mean_duration, sigma = 3600.0, 0.8
    rate = load * gpus / (mean_gpus * mean_duration)
    jobs, t = [], 0.0
    while t < hours * 3600:
        t += rng.expovariate(rate)
        if rng.random() < MULTI_SHARE:
            pods, k = rng.choices(PODS, PODS_WEIGHTS)[0], rng.choices(PER_POD, PER_POD_WEIGHTS)[0]
        else:
            pods, k = 1, rng.choices(SINGLE_SIZES, SINGLE_WEIGHTS)[0]
        duration = rng.lognormvariate(math.log(mean_duration) - sigma**2 / 2, sigma)
        jobs.append(TrainJob(len(jobs), t, pods, k, duration))
    return jobs


# -- policies ------------------------------------------------------------------------------------------------------


def per_pod(choose: Callable[[Sequence[Node], PodJob, random.Random], tuple[Node, tuple[int, ...]] | None]) -> PolicyFn:
    """Place a job pod by pod with a single-pod policy; the gang starts only when every pod found a place."""

    def policy(nodes: Sequence[Node], job: TrainJob, rng: random.Random) -> Placement | None:
        placed: Placement = []
        pod = PodJob(job.id, job.arrival, job.gpus_per_pod, job.duration)
        for _ in range(job.pods):
            choice = choose(nodes, pod, rng)
            if choice is None:
                for n, gpus in placed:
                    n.free.update(gpus)
                return None
            n, gpus = choice
            n.free.difference_update(gpus)
            placed.append((n, gpus))
        for n, gpus in placed:  # the simulator commits the placement itself
            n.free.update(gpus)
        return placed

    return policy


def blind_pod(nodes: Sequence[Node], pod: PodJob, rng: random.Random) -> tuple[Node, tuple[int, ...]] | None:
    node = least_allocated(nodes, pod, rng)
    if node is None:
        return None
    return node, tuple(sorted(rng.sample(sorted(node.free), pod.size)))


class RackLevel:
    """Policy (c): the smallest domain holding the job, fullest first; nodes with the most free GPUs first."""

    def __init__(self, places: dict[str, tuple[str | None, ...]]) -> None:
        self.places = places

    def __call__(self, nodes: Sequence[Node], job: TrainJob, rng: random.Random) -> Placement | None:
        k = job.gpus_per_pod
        for level in range(len(LOCALITY.levels) + 1):
            domains: dict[tuple, list[Node]] = {}
            for n in nodes:
                domains.setdefault(self.places[n.name][level:], []).append(n)
            fitting = [(sum(len(n.free) for n in d), d) for d in domains.values()
                       if sum(len(n.free) // k for n in d) >= job.pods]
            if not fitting:
                continue
            _, domain = min(fitting, key=lambda fd: (fd[0], fd[1][0].name))
            placed: Placement = []
            free = {n.name: set(n.free) for n in domain}
            for _ in range(job.pods):
                n = max((n for n in domain if len(free[n.name]) >= k), key=lambda n: (len(free[n.name]), n.name))
                gpus = best_subset(n.topo, free[n.name], k).gpus
                free[n.name].difference_update(gpus)
                placed.append((n, gpus))
            return placed
        return None


class JobAware:
    """Policy (d): the planner over a snapshot of every node for a job of several pods; a single pod is no job, and
    stays with today's per-pod extender (as in the product)."""

    def __init__(self, places: dict[str, tuple[str | None, ...]]) -> None:
        self.places = places
        self.single = per_pod(ExtenderPolicy())

    def __call__(self, nodes: Sequence[Node], job: TrainJob, rng: random.Random) -> Placement | None:
        if job.pods == 1:
            return self.single(nodes, job, rng)
        by_name = {n.name: n for n in nodes}
        snaps = [NodeSnapshot(n.name, n.topo, mask_of(n.free), self.places[n.name]) for n in nodes]
        try:
            plan = plan_job(JobRequest(f"job-{job.id}", job.gpus_per_pod, job.pods), snaps, LOCALITY)
        except (JobUnplaceable, JobPlanError):
            return None
        return [(by_name[s.node], s.gpus) for s in plan.slots]


# -- simulation ----------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    placed: list[tuple[TrainJob, float, int, bool]] = field(default_factory=list)  # job, GB/s, split, one node
    kinds: list[str] = field(default_factory=list)  # machine kind of each placed job's first node
    split_with_room: int = 0  # multi-pod jobs placed across racks while one rack had room for them
    frag_jobs: set[int] = field(default_factory=set)
    busy_gpu_s: float = 0.0
    window_s: float = 0.0
    gpus: int = 0
    plan_s: list[float] = field(default_factory=list)


def simulate(policy: PolicyFn, jobs: Sequence[TrainJob], seed: int) -> Outcome:
    nodes, places = build_cluster()
    if isinstance(policy, (RackLevel, JobAware)):
        policy.places = places
    rng = random.Random(seed)
    out = Outcome(gpus=sum(n.topo.size for n in nodes))
    events: list[tuple[float, int, int, TrainJob, Placement]] = []
    for job in jobs:
        heapq.heappush(events, (job.arrival, 1, job.id, job, []))
    pending: list[TrainJob] = []
    busy, now, free_total = 0, 0.0, out.gpus
    w_start, w_end = 0.1 * jobs[-1].arrival, jobs[-1].arrival
    while events:
        t, kind, _, job, placement = heapq.heappop(events)
        out.busy_gpu_s += busy * max(0.0, min(t, w_end) - max(now, w_start))
        now = t
        if kind == 0:
            for n, gpus in placement:
                n.free.update(gpus)
            busy -= job.gpus
            free_total += job.gpus
        else:
            pending.append(job)
        still = []
        for p in pending:
            if p.gpus > free_total:
                still.append(p)
                continue
            t0 = time.perf_counter()
            choice = policy(nodes, p, rng)
            out.plan_s.append(time.perf_counter() - t0)
            if choice is None:
                out.frag_jobs.add(p.id)
                still.append(p)
                continue
            assert len(choice) == p.pods
            k = p.gpus_per_pod
            for n, gpus in choice:
                assert len(gpus) == k and set(gpus) <= n.free
                n.free.difference_update(gpus)
            busy += p.gpus
            free_total -= p.gpus
            est = job_allreduce_gbps([PodSlot(n.name, n.topo, g, places[n.name]) for n, g in choice], LOCALITY)
            out.placed.append((p, est.gbps, est.split, est.nodes == 1))
            out.kinds.append(choice[0][0].kind)
            if p.pods > 1 and est.split >= 0:
                room: dict[str | None, int] = {}
                for n in nodes:
                    rack = places[n.name][0]
                    room[rack] = room.get(rack, 0) + (len(n.free) + sum(len(g) for m, g in choice if m is n)) // k
                out.split_with_room += max(room.values()) >= p.pods
            heapq.heappush(events, (now + p.duration, 0, p.id, p, choice))
        pending = still
    out.window_s = w_end - w_start
    return out


@dataclass
class Summary:
    jobs: int
    multi: int
    mean_gbps: float
    p10_gbps: float
    rack_share: float
    node_share: float
    single_gbps: float
    frag_jobs: int
    utilisation: float
    by_pods: dict[int, float]
    fastest_share: dict[int, float]  # pods per job -> share of those jobs placed on the fastest-NIC machine kind
    split_with_room: int


def summarise(out: Outcome) -> Summary:
    multi = [p for p in out.placed if p[0].pods > 1]
    singles = [p for p in out.placed if p[0].pods == 1 and p[0].gpus_per_pod > 1]
    by_pods: dict[int, list[float]] = {}
    for job, gbps, _, _ in multi:
        by_pods.setdefault(job.pods, []).append(gbps)
    fastest = max(FLEET, key=lambda kind: FLEET[kind][1])
    on_fastest: dict[int, list[bool]] = {}
    for (job, _, _, _), kind in zip(out.placed, out.kinds, strict=True):
        if job.pods > 1:
            on_fastest.setdefault(job.pods, []).append(kind == fastest)
    return Summary(
        jobs=len(out.placed),
        multi=len(multi),
        mean_gbps=statistics.fmean(g for _, g, _, _ in multi),
        p10_gbps=percentile([g for _, g, _, _ in multi], 10),
        rack_share=sum(1 for _, _, split, _ in multi if split < 0) / len(multi),
        node_share=sum(1 for _, _, _, one in multi if one) / len(multi),
        single_gbps=statistics.fmean(g for _, g, _, _ in singles),
        frag_jobs=len(out.frag_jobs),
        utilisation=out.busy_gpu_s / (out.gpus * out.window_s),
        by_pods={k: statistics.fmean(v) for k, v in sorted(by_pods.items())},
        fastest_share={k: statistics.fmean(v) for k, v in sorted(on_fastest.items())},
        split_with_room=out.split_with_room,
    )


def plot(results: dict[str, Summary], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [
        ("mean job all-reduce GB/s\n(multi-pod jobs)", lambda s: s.mean_gbps),
        ("p10 job all-reduce GB/s", lambda s: s.p10_gbps),
        ("multi-pod jobs inside one rack", lambda s: s.rack_share),
        ("jobs that waited on fragmentation", lambda s: s.frag_jobs),
        ("GPU utilisation", lambda s: s.utilisation),
    ]
    fig, axes = plt.subplots(1, len(metrics), figsize=(19, 4.2))
    colours = ["#c44e52", "#dd8452", "#8172b3", "#4c72b0"]
    policy_bars(axes, metrics, results, POLICIES, colours)
    fig.suptitle("Multi-pod jobs under churn: (a) topology-blind, (b) per-pod extender, (c) rack-level only, "
                 "(d) job-aware planner", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# -- planning latency at 5,000 nodes -------------------------------------------------------------------------------


def latency(n_nodes: int, seed: int, rounds: int) -> dict[int, tuple[float, float, float, float, float]]:
    """Per GPUs per pod, CPU ms to plan a 32-pod job: the first call (cold memo), then warm calls on an unchanged
    snapshot (p50, p99: the planning itself), then warm calls with 1% of the nodes changing state between calls,
    as a scheduler's cache does under load (p50, p99: planning plus the pod choices of states not seen before).
    The snapshot cycles the fleet's machine kinds rack by rack (32 nodes a rack, 8 racks a spine), 40% of nodes
    empty, the rest with a random set of GPUs in use."""
    rng = random.Random(seed)
    kinds = list(FLEET)
    topos = [with_rate(load_topology_file(SHARED / "topologies" / f"{k}.txt"), FLEET[k][1]) for k in kinds]
    snaps = []
    for i in range(n_nodes):
        rack = i // 32
        topo = topos[rack % len(topos)]
        full = (1 << topo.size) - 1
        free = full if rng.random() < 0.4 else rng.getrandbits(topo.size)
        snaps.append(NodeSnapshot(f"n{i}", topo, free, (f"r{rack}", f"s{rack // 8}")))

    def timed() -> float:
        """CPU time of this thread: the machine is shared, and wall time would also count other processes."""
        t0 = time.thread_time()
        plan_job(request, snaps, LOCALITY)
        return (time.thread_time() - t0) * 1000

    out = {}
    for k in (1, 2, 4, 8):
        request = JobRequest("bench/train", k, 32)
        cold = timed()
        still = [timed() for _ in range(rounds)]
        moving = []
        for _ in range(rounds):
            for _ in range(n_nodes // 100):
                j = rng.randrange(n_nodes)
                s = snaps[j]
                snaps[j] = NodeSnapshot(s.name, s.topo, rng.getrandbits(s.topo.size), s.place)
            moving.append(timed())
        out[k] = (cold, percentile(still, 50), percentile(still, 99), percentile(moving, 50), percentile(moving, 99))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=24.0, help="simulated time (default 24)")
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--load", type=float, default=0.9, help="offered load as a share of GPU capacity")
    parser.add_argument("--nodes", type=int, default=5000, help="nodes for the planning latency")
    parser.add_argument("--rounds", type=int, default=50, help="warm planning calls per pod size")
    args = parser.parse_args()
    started = time.time()
    nodes, _ = build_cluster()
    gpus = sum(n.topo.size for n in nodes)
    jobs = trace(args.seed, args.hours, gpus, args.load)
    places = build_cluster()[1]
    fns: dict[str, Callable[[], PolicyFn]] = {
        POLICIES[0]: lambda: per_pod(blind_pod),
        POLICIES[1]: lambda: per_pod(ExtenderPolicy()),
        POLICIES[2]: lambda: RackLevel(places),
        POLICIES[3]: lambda: JobAware(places),
    }
    results: dict[str, Summary] = {}
    plan_ms: dict[str, float] = {}
    for name, make in fns.items():
        t0 = time.time()
        out = simulate(make(), jobs, args.seed)
        results[name] = summarise(out)
        plan_ms[name] = percentile([s * 1000 for s in out.plan_s], 99)
        print(f"  {name} done in {time.time() - t0:.1f} s", flush=True)
    fleet = ", ".join(f"{racks} racks of {kind} ({gbit:g} Gb/s NICs)" for kind, (racks, gbit) in FLEET.items())
    rows = [[name, s.jobs, s.multi, f"{s.mean_gbps:.1f}", f"{s.p10_gbps:.1f}", f"{s.rack_share:.3f}",
             f"{s.node_share:.3f}", f"{s.single_gbps:.1f}", s.frag_jobs, f"{s.utilisation:.3f}",
             f"{plan_ms[name]:.1f}"] for name, s in results.items()]
    sizes = sorted({k for s in results.values() for k in s.by_pods})
    size_rows = [[name, *[f"{s.by_pods.get(k, math.nan):.1f}" for k in sizes]] for name, s in results.items()]
    a, b, c, d = (results[p] for p in POLICIES)
    text = [
        "# Multi-pod jobs under cluster churn\n",
        f"`python -m bench.jobs --hours {args.hours:g} --seed {args.seed} --load {args.load:g} --nodes {args.nodes} "
        f"--rounds {args.rounds}` on {machine_line()}.\n",
        f"{len(nodes)} servers, {gpus} GPUs in {len(nodes) // NODES_PER_RACK} racks of {NODES_PER_RACK} "
        f"({RACKS_PER_SPINE} spines): {fleet}. {len(jobs)} jobs, {MULTI_SHARE:.0%} of them multi-pod "
        f"({'/'.join(map(str, PODS))} pods of {'/'.join(map(str, PER_POD))} GPUs). All-reduce figures are the job "
        "model's estimates (gputopo.core.jobs), not measurements.\n",
        markdown_table(["policy", "jobs placed", "multi-pod jobs", "mean job all-reduce GB/s (multi-pod)",
                        "p10 GB/s", "inside one rack", "on one node", "mean GB/s single-pod multi-GPU",
                        "jobs that waited on fragmentation", "GPU utilisation", "policy call p99 ms"], rows),
        "\nMean estimated job all-reduce GB/s by pods per job:\n",
        markdown_table(["policy", *[f"{k} pods" for k in sizes]], size_rows),
        f"\n(d) / (b) mean multi-pod job all-reduce: {d.mean_gbps / b.mean_gbps:.2f}x (target >= 1.5x); "
        f"(d) / (c): {d.mean_gbps / c.mean_gbps:.2f}x; p10 (d) {d.p10_gbps:.1f} vs (c) {c.p10_gbps:.1f}; "
        f"inside one rack (d) {d.rack_share:.3f} vs (c) {c.rack_share:.3f}; fragmentation waits (d) {d.frag_jobs} "
        f"vs (b) {b.frag_jobs} vs (c) {c.frag_jobs}; utilisation (d) {d.utilisation:.3f} vs (c) "
        f"{c.utilisation:.3f}; (a) for reference {a.mean_gbps:.1f} GB/s.\n",
        f"\nWhy (d) trails (c) on large jobs: share of multi-pod jobs placed on the fastest-NIC racks "
        f"({max(FLEET, key=lambda kind: FLEET[kind][1])}), by pods per job, and multi-pod jobs placed across racks "
        "while one rack had room for them:\n",
        markdown_table(["policy", *[f"{k} pods" for k in sizes], "split across racks with a rack free"],
                       [[name, *[f"{s.fastest_share.get(k, math.nan):.2f}" for k in sizes], s.split_with_room]
                        for name, s in results.items()]),
    ]
    print("\n".join(text), flush=True)
    lat = latency(args.nodes, args.seed, args.rounds)
    lat_rows = [[f"32 x {k} GPUs", *[f"{v:.1f}" for v in row]] for k, row in lat.items()]
    text += [
        f"\n## Planning latency: a 32-pod job on {args.nodes:,} nodes\n",
        "Snapshot: the fleet's machine kinds rack by rack (32 nodes a rack, 8 racks a spine), 40% of nodes empty, "
        f"the rest with random GPUs in use. {args.rounds} warm calls per series; in the second, 1% of the nodes "
        "change to a random state between calls, so some calls meet node states never seen and pay the allocator's "
        "cold choices for them. In-process `plan_job` call, no HTTP; CPU time of the calling thread (this 2-core "
        "machine is shared, so wall time would count other processes too).\n",
        markdown_table(["job", "first call ms (cold memo)", "same snapshot p50 ms", "same snapshot p99 ms",
                        "1% nodes changed p50 ms", "1% nodes changed p99 ms"], lat_rows),
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(results, str(RESULTS / "jobs.png"))
    text.append(f"\n![jobs](jobs.png)\n\nRun time {time.time() - started:.0f} s.\n")
    (RESULTS / "jobs.md").write_text("\n".join(text))
    print("\n".join(text[-3:]))


if __name__ == "__main__":
    main()
