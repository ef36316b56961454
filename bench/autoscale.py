"""A day of mixed GPU work on node groups the Cluster Autoscaler grows and shrinks:
`python -m bench.autoscale [--hours H] [--seed S] [--out STEM] [--quick]`.

Seeded discrete-event simulation. The autoscaler is sim/autoscaler.py (CA's in-tree fit, scale-up and scale-down rules
with their defaults, docs/reference/autoscaling.md); the scheduling policies place pods on the nodes it provides:
  default                     kube-scheduler LeastAllocated (spreads) + NVIDIA plugin best subset, pod by pod
  most-allocated              the same with MostAllocated on nvidia.com/gpu (bin-packing for autoscaling)
  most-allocated + affinity   the same, the NVLink / bandwidth needs as required node affinity on our labels
  ours before                 the extender's engine (single pods) and job planner (gangs) as they were: no
                              consolidation, kube-scheduler's LeastAllocated among equals; CA sees GPU counts only
  ours before + affinity      the same with the labels and the webhook's node affinity, so CA sees the needs
  ours                        now: consolidation in the engine, MostAllocated among equals, labels and affinity
KAI Scheduler's Consolidate action is not modelled (see the results file).
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.common import RESULTS, SHARED, machine_line, markdown_table, percentile
from extender.jobs.planner import JobPlanError, JobRequest, JobUnplaceable, NodeSnapshot, plan_job
from extender.state.pods import pod_needs
from gputopo.contract import DEFAULT_KEYS, NVLINK_FABRICS
from gputopo.core import Topology, allreduce_gbps, best_possible_gbps, best_subset
from gputopo.core.bitset import mask_of
from gputopo.core.jobs import PodSlot, job_allreduce_gbps
from gputopo.core.locality import Level, Locality
from gputopo.discovery.loader import load_topology_file
from sim import autoscaler as ca

GPU = "nvidia.com/gpu"
STARTUP_S = 300.0  # new node usable 5 min after CA asks (GCE 3-4 min, AKS A100 5-10 min: reference section 4)
SHARING_LABEL = "nvidia.com/gpu.sharing-strategy"  # GPU feature discovery's label on time-sliced nodes
SHARED_TAINT = {"key": "nvidia.com/gpu.shared", "value": "true", "effect": "NoSchedule"}  # ASSUMED team practice
GPU_LABEL = "k8s.amazonaws.com/accelerator"  # CA's provider GPU label (AWS)
LOCALITY = Locality((Level("rack", ("example.com/rack",)),))  # ASSUMED: every node in one rack
PLACE = ("r0",)
MIN_GBPS = 100.0  # the min-allreduce-gbps pods ask: above any PCIe ring of the fixtures, below NVSwitch


@dataclass(frozen=True)
class GroupSpec:
    name: str
    fixture: str
    min_size: int
    max_size: int
    price: float  # relative cost per node-hour, ASSUMED; only the expander's tie-break reads it
    replicas: int = 0  # time-slicing replicas per GPU; 0: whole GPUs


GROUPS = (
    GroupSpec("nvswitch", "dgx-a100-8gpu-10nic-1mcprddgx05", 0, 24, 1.0),
    GroupSpec("pcie", "pcie-8x-rtx5090-2socket-sglang23020", 0, 24, 0.4),
    GroupSpec("shared", "aws-g6e.12xlarge-4xL40S", 1, 10, 0.3, replicas=4),
)


# -- the load ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Work:
    """One arrival: a job of `pods` pods of `k` GPUs (or replicas when `shared`)."""

    id: int
    arrival: float
    kind: str
    pods: int
    k: int
    duration: float
    shared: bool = False
    require_nvlink: bool = False
    min_gbps: float = 0.0
    blocks: bool = False  # safe-to-evict "false" (notebooks with local state)


# kind -> arrivals per hour at the daily peak; the diurnal factor scales them
PEAK_RATES = {"train": 3.0, "katib": 2.0, "multi": 10.0, "inference": 15.0, "notebook": 8.0}


def diurnal(t: float) -> float:
    """Share of the peak arrival rate at time t: 0.1 at night, 1 at 13:00, a sine from 06:00 to 20:00."""
    h = (t / 3600.0) % 24
    return 0.1 + 0.9 * max(0.0, math.sin(math.pi * (h - 6) / 14)) if 6 <= h <= 20 else 0.1


def _lognormal(rng: random.Random, mean: float, sigma: float = 0.6) -> float:
    return rng.lognormvariate(math.log(mean) - sigma**2 / 2, sigma)


def trace(seed: int, hours: float) -> list[Work]:
    """Non-homogeneous Poisson arrivals per kind (thinning against the diurnal factor)."""
    rng = random.Random(seed)
    out: list[Work] = []
    for kind, peak in PEAK_RATES.items():
        t = 0.0
        while True:
            t += rng.expovariate(peak / 3600.0)
            if t >= hours * 3600:
                break
            if rng.random() > diurnal(t):
                continue
            if kind == "train":  # PyTorchJob / MPIJob: 2-4 workers of 8 or 4 GPUs
                k = rng.choice((8, 8, 8, 4, 4))
                w = Work(0, t, kind, rng.randint(2, 4), k, _lognormal(rng, 2.5 * 3600),
                         require_nvlink=rng.random() < 0.5)
            elif kind == "katib":  # a burst of single-GPU trials
                for _ in range(rng.randint(8, 24)):
                    out.append(Work(0, t, kind, 1, 1, rng.uniform(1200, 3600)))
                continue
            elif kind == "multi":
                k = rng.choice((2, 2, 4, 4, 8))
                u = rng.random()
                w = Work(0, t, kind, 1, k, _lognormal(rng, 1.5 * 3600), require_nvlink=u < 0.3,
                         min_gbps=MIN_GBPS if 0.3 <= u < 0.55 else 0.0)
            elif kind == "inference":
                w = Work(0, t, kind, 1, 1, _lognormal(rng, 3 * 3600), shared=True)
            else:
                w = Work(0, t, kind, 1, 1, _lognormal(rng, 4 * 3600), shared=rng.random() < 0.6, blocks=True)
            out.append(w)
    out.sort(key=lambda w: (w.arrival, w.kind))
    return [Work(i, w.arrival, w.kind, w.pods, w.k, w.duration, w.shared, w.require_nvlink, w.min_gbps, w.blocks)
            for i, w in enumerate(out)]


# -- Kubernetes-shaped objects -------------------------------------------------------------------------------------


def node_labels(group: GroupSpec, topo: Topology, visible: bool) -> dict[str, str]:
    labels = {"node.kubernetes.io/instance-type": group.fixture, GPU_LABEL: group.name}
    if group.replicas:
        labels[SHARING_LABEL] = "time-slicing"
    if visible:  # what the product publishes (gpuplugin.publisher) for CA to read
        labels[DEFAULT_KEYS.fabric_label] = topo.fabric
        for k in range(2, topo.size + 1):
            labels[DEFAULT_KEYS.allreduce_label(k)] = str(int(best_possible_gbps(topo, k)))
    return labels


def node_dict(name: str, group: GroupSpec, topo: Topology, visible: bool) -> dict[str, Any]:
    gpus = topo.size * (group.replicas or 1)
    return {
        "metadata": {"name": name, "labels": node_labels(group, topo, visible)},
        "spec": {"taints": [dict(SHARED_TAINT)] if group.replicas else []},
        "status": {"allocatable": {GPU: gpus, "pods": 110}},
    }


def pod_dict(work: Work, index: int, visible: bool) -> dict[str, Any]:
    """The pod as the apiserver holds it; with `visible`, after the webhook added the constraints as node affinity."""
    ann: dict[str, str] = {}
    if work.require_nvlink:
        ann[DEFAULT_KEYS.require_nvlink] = "true"
    if work.min_gbps:
        ann[DEFAULT_KEYS.min_gbps] = f"{work.min_gbps:g}"
    if work.blocks:
        ann[ca.SAFE_TO_EVICT] = "false"
    spec: dict[str, Any] = {"containers": [{"name": "main", "resources": {"limits": {GPU: work.k}}}]}
    if work.shared:
        spec["nodeSelector"] = {SHARING_LABEL: "time-slicing"}
        spec["tolerations"] = [{"key": SHARED_TAINT["key"], "operator": "Exists", "effect": "NoSchedule"}]
    exprs = []
    if visible and work.k >= 2 and work.require_nvlink:
        exprs.append({"key": DEFAULT_KEYS.fabric_label, "operator": "In", "values": list(NVLINK_FABRICS)})
    if visible and work.k >= 2 and work.min_gbps:
        exprs.append({"key": DEFAULT_KEYS.allreduce_label(work.k), "operator": "Gt",
                      "values": [str(math.ceil(work.min_gbps) - 1)]})
    if exprs:
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": exprs}]}}}
    return {
        "metadata": {"name": f"{work.kind}-{work.id}-{index}", "namespace": "ml", "uid": f"{work.id}-{index}",
                     "annotations": ann, "ownerReferences": [{"kind": "Job", "name": f"w{work.id}"}]},
        "spec": spec,
    }


# -- simulation state ----------------------------------------------------------------------------------------------


@dataclass(eq=False)
class Node:
    name: str
    group: GroupSpec
    topo: Topology
    obj: dict[str, Any]
    ready_at: float
    free: set[int]
    used: dict[str, int] = field(default_factory=dict)  # what CA and the scheduler charge: GPU requests, pods
    pods: set[int] = field(default_factory=set)

    def ready(self, now: float) -> bool:
        return now >= self.ready_at


@dataclass(eq=False)
class Pod:
    id: int
    work: Work
    obj: dict[str, Any]
    requests: dict[str, int]
    remaining: float
    since: float  # created, or re-created after an eviction: CA's pod age
    node: Node | None = None
    gpus: tuple[int, ...] = ()
    started: float = 0.0
    epoch: int = 0
    stuck: bool = False


@dataclass
class Stats:
    pending_s: list[float] = field(default_factory=list)
    job_pending_s: list[float] = field(default_factory=list)
    pod_gbps: list[float] = field(default_factory=list)
    job_gbps: list[float] = field(default_factory=list)
    node_s: dict[str, float] = field(default_factory=dict)
    stuck_pods: int = 0
    stuck_s: float = 0.0
    scale_ups: int = 0
    nodes_added: int = 0
    scale_downs: int = 0
    evictions: int = 0
    pending_end: int = 0
    pods: int = 0
    series_t: list[float] = field(default_factory=list)
    series_nodes: dict[str, list[int]] = field(default_factory=dict)
    series_pending: list[int] = field(default_factory=list)


# -- policies ------------------------------------------------------------------------------------------------------

Choice = list[tuple["Pod", Node, tuple[int, ...]]]


class KubeScheduler:
    """In-tree filters (the same as CA's: sim.autoscaler.fits) and NodeResourcesFit scoring: LeastAllocated spreads,
    MostAllocated packs, on the GPU request ratio (stand-in for the CPU/memory GPU pods request in proportion). The
    device plugin then takes the best subset at the kubelet. Pods of a job are placed one by one."""

    gang = False

    def __init__(self, most_allocated: bool, rng: random.Random) -> None:
        self.most = most_allocated
        self.rng = rng

    def feasible(self, pod: Pod, nodes: Sequence[Node]) -> list[Node]:
        return [n for n in nodes if ca.fits(pod.obj, n.obj, n.used, pod.requests) is None]

    def pick(self, pod: Pod, cands: Sequence[Node], most: bool) -> Node:
        def ratio(n: Node) -> float:
            alloc = n.obj["status"]["allocatable"][GPU]
            return (n.used.get(GPU, 0) + pod.work.k) / alloc
        best = max(ratio(n) for n in cands) if most else min(ratio(n) for n in cands)
        return self.rng.choice([n for n in cands if ratio(n) == best])

    def place_pod(self, pod: Pod, nodes: Sequence[Node]) -> tuple[Node, tuple[int, ...]] | None:
        cands = self.feasible(pod, nodes)
        if not cands:
            return None
        node = self.pick(pod, cands, self.most)
        if pod.work.shared:
            return node, ()
        return node, best_subset(node.topo, node.free, pod.work.k).gpus

    def place(self, pods: Sequence[Pod], nodes: Sequence[Node]) -> Choice | None:
        assert len(pods) == 1
        got = self.place_pod(pods[0], nodes)
        return [(pods[0], *got)] if got else None


class Ours(KubeScheduler):
    """The product: kube-scheduler's in-tree filters first, then the extender's engine (extender.placement.engine)
    for single pods as bench/placement.py's ExtenderPolicy drives it, and the job planner (extender.jobs.planner)
    for a job whose pods are all pending (gang). Time-sliced pods: kube-scheduler's default LeastAllocated (the
    engine's replica path is not driven here)."""

    gang = True

    def __init__(self, rng: random.Random, most_allocated: bool = True, **config: Any) -> None:
        super().__init__(most_allocated, rng)
        from extender.config import ExtenderConfig
        from extender.placement.engine import Placement
        from extender.state.cache import NodeCache
        from extender.state.reservations import Reservations

        cfg = ExtenderConfig(**config)
        self.cache = NodeCache(cfg, Reservations(cfg.reservation_timeout_s))
        self.engine = Placement(self.cache)
        self._seen: dict[str, frozenset[int]] = {}

    def _sync(self, nodes: Sequence[Node]) -> None:
        from extender.state.cache import make_entry

        names = {n.name for n in nodes}
        for gone in [n for n in self._seen if n not in names]:
            self.cache.remove_node(gone)
            del self._seen[gone]
        for n in nodes:
            free = frozenset(n.free)
            if self._seen.get(n.name) != free:
                used = [g.id for g in n.topo.gpus if g.index not in free]
                self.cache.put_node(make_entry(n.name, n.topo, used=used))
                self._seen[n.name] = free

    def place_pod(self, pod: Pod, nodes: Sequence[Node]) -> tuple[Node, tuple[int, ...]] | None:
        cands = self.feasible(pod, nodes)
        if not cands or pod.work.shared:
            return super().place_pod(pod, nodes) if cands else None
        self._sync([n for n in nodes if not n.group.replicas])
        need = pod_needs(pod.obj, GPU, DEFAULT_KEYS).need
        by_name = {n.name: n for n in cands}
        passed = self.engine.filter(list(by_name), need).passed
        if not passed:
            return None
        # kube-scheduler skips prioritize when one node is left; its own NodeResourcesFit score breaks the engine's
        # ties (the chart's profile: MostAllocated on the GPU resource; before: kube-scheduler's LeastAllocated)
        scores = dict(zip(passed, self.engine.score(passed, need), strict=True)) if len(passed) > 1 else {}
        scores = scores or {passed[0]: 0}
        top = max(scores.values())
        node = self.pick(pod, [by_name[n] for n in passed if scores[n] == top], self.most)
        entry = self.cache.nodes[node.name]
        return node, self.engine.choose(entry, self.cache.free_mask(entry), need).gpus

    def place(self, pods: Sequence[Pod], nodes: Sequence[Node]) -> Choice | None:
        if len(pods) == 1:
            return super().place(pods, nodes)
        first = pods[0]
        cands = self.feasible(first, nodes)
        if not cands:
            return None
        by_name = {n.name: n for n in cands}
        snaps = [NodeSnapshot(n.name, n.topo, mask_of(n.free), PLACE) for n in cands]
        w = first.work
        req = JobRequest(f"ml/job-{w.id}", w.k, len(pods), require_nvlink=w.require_nvlink, min_gbps=w.min_gbps)
        try:
            plan = plan_job(req, snaps, LOCALITY)
        except (JobUnplaceable, JobPlanError):
            return None
        return [(p, by_name[s.node], s.gpus) for p, s in zip(pods, plan.slots, strict=True)]


@dataclass(frozen=True)
class PolicySpec:
    name: str
    visible: bool  # CA and the scheduler see the constraints as node labels + required affinity
    make: Callable[[random.Random], KubeScheduler]


def policies() -> list[PolicySpec]:
    from extender.config import ExtenderConfig

    out = [
        PolicySpec("default", False, lambda rng: KubeScheduler(False, rng)),
        PolicySpec("most-allocated", False, lambda rng: KubeScheduler(True, rng)),
        PolicySpec("most-allocated + affinity", True, lambda rng: KubeScheduler(True, rng)),
        PolicySpec("ours before", False, lambda rng: Ours(rng, False, consolidate=False)),
        PolicySpec("ours before + affinity", True, lambda rng: Ours(rng, False, consolidate=False)),
        PolicySpec("ours", True, lambda rng: Ours(rng)),
    ]
    assert "consolidate" in ExtenderConfig.model_fields
    return out


# -- the simulation ------------------------------------------------------------------------------------------------


class Sim:
    def __init__(self, spec: PolicySpec, works: Sequence[Work], hours: float, seed: int) -> None:
        self.spec = spec
        self.rng = random.Random(seed)
        self.policy = spec.make(self.rng)
        self.works = works
        self.end = hours * 3600.0
        self.topos = {g.name: load_topology_file(SHARED / "topologies" / f"{g.fixture}.txt") for g in GROUPS}
        self.groups = {g.name: g for g in GROUPS}
        self.ca_groups = [ca.NodeGroup(g.name, node_dict(f"{g.name}-template", g, self.topos[g.name], spec.visible),
                                       g.min_size, g.max_size, g.price) for g in GROUPS]
        self.nodes: dict[str, Node] = {}
        self.pods: dict[int, Pod] = {}
        self.pending: dict[int, Pod] = {}  # insertion order = queue order
        self.job_pods: dict[int, list[int]] = {}
        self.job_created: dict[int, float] = {}
        self.job_done: set[int] = set()
        self.events: list[tuple[float, int, int, int, int]] = []  # (t, order, seq, pod or work id, epoch)
        self.seq = 0
        self.serial = 0
        self.last_scale_up: float | None = None
        self.unneeded = ca.Unneeded()
        self.stats = Stats(node_s={g.name: 0.0 for g in GROUPS},
                           series_nodes={g.name: [] for g in GROUPS})
        for g in GROUPS:
            for _ in range(g.min_size):
                self.add_node(g, -STARTUP_S)

    # events: 0 departure, 1 node ready, 2 arrival (same instant: free first, then arrive)
    def push(self, t: float, order: int, ident: int, epoch: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, order, self.seq, ident, epoch))

    def add_node(self, g: GroupSpec, now: float) -> Node:
        self.serial += 1
        name = f"{g.name}-{self.serial:04d}"
        topo = self.topos[g.name]
        n = Node(name, g, topo, node_dict(name, g, topo, self.spec.visible), now + STARTUP_S, set(range(topo.size)))
        self.nodes[name] = n
        if now >= 0:
            self.push(n.ready_at, 1, 0)
        return n

    def ready_nodes(self, now: float) -> list[Node]:
        return [n for n in self.nodes.values() if n.ready(now)]

    # -- placement ------------------------------------------------------------------------------------------------

    def commit(self, pod: Pod, node: Node, gpus: tuple[int, ...], now: float) -> None:
        assert pod.node is None
        if node.group.replicas:
            assert not gpus
        else:
            assert len(gpus) == pod.work.k and set(gpus) <= node.free, "GPU double-booked"
            node.free.difference_update(gpus)
        for r, v in pod.requests.items():
            node.used[r] = node.used.get(r, 0) + v
        node.used["pods"] = node.used.get("pods", 0) + 1
        assert node.used.get(GPU, 0) <= node.obj["status"]["allocatable"][GPU]
        node.pods.add(pod.id)
        pod.node, pod.gpus, pod.started, pod.stuck = node, gpus, now, False
        self.pending.pop(pod.id, None)
        self.stats.pending_s.append(now - pod.since)
        if len(gpus) >= 2:
            self.stats.pod_gbps.append(allreduce_gbps(node.topo, gpus))
        self.push(now + pod.remaining, 0, pod.id, pod.epoch)

    def release(self, pod: Pod, now: float) -> None:
        node = pod.node
        assert node is not None
        node.free.update(pod.gpus)
        for r, v in pod.requests.items():
            node.used[r] -= v
        node.used["pods"] -= 1
        node.pods.discard(pod.id)
        pod.remaining = max(0.0, pod.remaining - (now - pod.started))
        pod.node, pod.gpus = None, ()

    def units(self) -> list[list[Pod]]:
        """Pending pods in queue order; with a gang policy, a job none of whose pods runs is one unit."""
        out: list[list[Pod]] = []
        seen: set[int] = set()
        for pod in self.pending.values():
            w = pod.work
            if w.id in seen:
                continue
            if self.policy.gang and w.pods > 1:
                ids = self.job_pods[w.id]
                if all(self.pods[i].node is None for i in ids):
                    seen.add(w.id)
                    out.append([self.pods[i] for i in ids])
                    continue
            out.append([pod])
        return out

    def schedule(self, now: float) -> None:
        nodes = self.ready_nodes(now)
        for unit in self.units():
            choice = self.policy.place(unit, nodes)
            if choice is None:
                continue
            for pod, node, gpus in choice:
                self.commit(pod, node, gpus, now)
            self.job_finished_placing(unit[0].work.id, now)

    def job_finished_placing(self, wid: int, now: float) -> None:
        w = self.works[wid]
        if w.pods == 1 or wid in self.job_done:
            return
        pods = [self.pods[i] for i in self.job_pods[wid]]
        if any(p.node is None for p in pods):
            return
        self.job_done.add(wid)
        self.stats.job_pending_s.append(now - self.job_created[wid])
        est = job_allreduce_gbps([PodSlot(p.node.name, p.node.topo, p.gpus, PLACE) for p in pods if p.node], LOCALITY)
        self.stats.job_gbps.append(est.gbps)

    # -- the autoscaler -------------------------------------------------------------------------------------------

    def snapshot(self, nodes: Sequence[Node]) -> list[ca.SimNode]:
        return [ca.SimNode(n.name, n.obj, dict(n.used)) for n in nodes]

    def ca_loop(self, now: float) -> None:
        ready = self.ready_nodes(now)
        upcoming = [n for n in self.nodes.values() if not n.ready(now) and now - n.ready_at + STARTUP_S
                    < ca.MAX_NODE_STARTUP_S]
        pending = list(self.pending.values())
        st = self.stats
        # filter-out-schedulable: existing nodes first, then upcoming ones (simulated from their group's template)
        snap = self.snapshot(ready) + [ca.SimNode(n.name, n.obj, {}) for n in upcoming]
        ready_names = {n.name for n in ready}
        left: list[Pod] = []
        on_ready: list[Pod] = []
        coming: set[int] = set()  # works (jobs, pods) some pod of which waits for a new node
        for pod in pending:
            where = ca.place_in_snapshot(pod.obj, pod.requests, snap)
            if where is None:
                left.append(pod)
                coming.add(id(pod.work))
            elif where.name in ready_names:
                on_ready.append(pod)
            else:
                coming.add(id(pod.work))
        for pod in on_ready:
            # CA believes it fits a node the scheduler already has, the policy refused it there, and no new node
            # is on its way for its job: nothing will change until a pod ends
            if id(pod.work) in coming or now - pod.since <= ca.GPU_POD_BUFFER_S + ca.SCAN_INTERVAL_S:
                continue
            if not pod.stuck:
                st.stuck_pods += 1
                pod.stuck = True
            st.stuck_s += ca.SCAN_INTERVAL_S
        if ca.too_young(now, [(p.since, ca.requests_gpu(p.requests)) for p in pending]):
            return
        scaled = False
        if left:
            sizes = {g: sum(1 for n in self.nodes.values() if n.group.name == g) for g in self.groups}
            opt = ca.scale_up(self.ca_groups, sizes, [(p.obj, p.requests) for p in left])
            if opt is not None and opt.nodes > 0:
                for _ in range(opt.nodes):
                    self.add_node(self.groups[opt.group.name], now)
                st.scale_ups += 1
                st.nodes_added += opt.nodes
                self.last_scale_up = now
                scaled = True
        # unneeded nodes are tracked in every loop that gets this far; removal waits out the cooldown
        self.scale_down(now, ready, not scaled and ca.scale_down_allowed(now, self.last_scale_up))

    def scale_down(self, now: float, ready: list[Node], allowed: bool) -> None:
        sizes = {g: sum(1 for n in self.nodes.values() if n.group.name == g) for g in self.groups}
        candidates = []
        for n in ready:
            alloc = {GPU: n.obj["status"]["allocatable"][GPU]}
            if sizes[n.group.name] <= n.group.min_size or not ca.underutilized(alloc, n.used):
                continue
            others = self.snapshot([m for m in ready if m is not n])
            pods = [(self.pods[i].obj, self.pods[i].requests) for i in sorted(n.pods)]
            if ca.can_drain(pods, others):
                candidates.append(n.name)
        self.unneeded.update(now, candidates)
        if not allowed:
            return
        removals = ca.pick_removals(self.unneeded.ready(now), lambda name: not self.nodes[name].pods)
        for name in removals:
            n = self.nodes[name]
            if sizes[n.group.name] <= n.group.min_size:
                continue
            sizes[n.group.name] -= 1
            for pid in sorted(n.pods):  # taint, evict: each pod's controller re-creates it, pending again
                pod = self.pods[pid]
                self.release(pod, now)
                pod.epoch += 1
                pod.since = now
                self.pending[pid] = pod
                self.stats.evictions += 1
            del self.nodes[name]
            self.stats.scale_downs += 1
        if removals:
            self.unneeded.update(now, [c for c in candidates if c in self.nodes])

    # -- main loop ------------------------------------------------------------------------------------------------

    def arrive(self, w: Work, now: float) -> None:
        ids = []
        for i in range(w.pods):
            pid = len(self.pods)
            obj = pod_dict(w, i, self.spec.visible)
            self.pods[pid] = Pod(pid, w, obj, ca.pod_requests(obj), w.duration, now)
            self.pending[pid] = self.pods[pid]
            ids.append(pid)
        self.job_pods[w.id] = ids
        self.job_created[w.id] = now

    def run(self) -> Stats:
        for w in self.works:
            self.push(w.arrival, 2, w.id)
        scan = 0.0
        st = self.stats
        while scan <= self.end:
            dirty = False
            while self.events and self.events[0][0] <= scan:
                t, order, _, ident, epoch = heapq.heappop(self.events)
                if order == 0:
                    pod = self.pods[ident]
                    if pod.epoch != epoch or pod.node is None:
                        continue  # evicted since
                    self.release(pod, t)
                elif order == 2:
                    self.arrive(self.works[ident], t)
                dirty = True
                if not self.events or self.events[0][0] > t:  # kube-scheduler reacts to each change
                    self.schedule(t)
                    dirty = False
            if dirty:
                self.schedule(scan)
            self.ca_loop(scan)
            if self.pending:
                self.schedule(scan)  # evicted pods go straight back to the scheduler
            for g in self.groups:
                count = sum(1 for n in self.nodes.values() if n.group.name == g)
                st.node_s[g] += count * ca.SCAN_INTERVAL_S
                st.series_nodes[g].append(count)
            st.series_t.append(scan)
            st.series_pending.append(len(self.pending))
            scan += ca.SCAN_INTERVAL_S
        st.pending_end = len(self.pending)
        st.pods = len(self.pods)
        return st


# -- report --------------------------------------------------------------------------------------------------------


def _mean(xs: Sequence[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def summary(st: Stats) -> dict[str, Any]:
    return {
        "gpu_node_hours": sum(st.node_s.values()) / 3600,
        "node_hours": {g: s / 3600 for g, s in st.node_s.items()},
        "pod_pending_mean_s": _mean(st.pending_s),
        "pod_pending_p95_s": percentile(st.pending_s, 95),
        "job_pending_mean_s": _mean(st.job_pending_s),
        "job_pending_p95_s": percentile(st.job_pending_s, 95),
        "jobs_placed": len(st.job_pending_s),
        "multi_gpu_pod_gbps_mean": _mean(st.pod_gbps),
        "job_gbps_mean": _mean(st.job_gbps),
        "stuck_pods": st.stuck_pods,
        "stuck_pod_hours": st.stuck_s / 3600,
        "scale_ups": st.scale_ups,
        "nodes_added": st.nodes_added,
        "scale_downs": st.scale_downs,
        "evictions": st.evictions,
        "pods": st.pods,
        "pending_at_end": st.pending_end,
    }


def _f(v: float, digits: int = 1) -> str:
    return "n/a" if v != v else f"{v:.{digits}f}"


def table(results: Mapping[str, dict[str, Any]]) -> str:
    header = ["policy", "GPU node-hours", *[f"{g.name} node-h" for g in GROUPS], "pod pending mean / p95 s",
              "job pending mean / p95 s", "GB/s multi-GPU pods", "GB/s jobs", "stuck pods (pod-h)",
              "scale-ups (nodes)", "scale-downs", "evictions", "pending at end"]
    rows = [[name, _f(s["gpu_node_hours"]), *[_f(s["node_hours"][g.name]) for g in GROUPS],
             f"{_f(s['pod_pending_mean_s'], 0)} / {_f(s['pod_pending_p95_s'], 0)}",
             f"{_f(s['job_pending_mean_s'], 0)} / {_f(s['job_pending_p95_s'], 0)}",
             _f(s["multi_gpu_pod_gbps_mean"]), _f(s["job_gbps_mean"]),
             f"{s['stuck_pods']} ({s['stuck_pod_hours']:.2f})", f"{s['scale_ups']} ({s['nodes_added']})",
             s["scale_downs"], s["evictions"], f"{s['pending_at_end']} of {s['pods']}"]
            for name, s in results.items()]
    return markdown_table(header, rows)


def plot(series: Mapping[str, Stats], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    for name, st in series.items():
        hours = [t / 3600 for t in st.series_t]
        total = [sum(v) for v in zip(*st.series_nodes.values(), strict=True)]
        axes[0].step(hours, total, where="post", label=name, linewidth=1.2)
        axes[1].step(hours, st.series_pending, where="post", label=name, linewidth=1.0)
    axes[0].set_ylabel("GPU nodes (incl. starting)")
    axes[1].set_ylabel("pending pods")
    axes[1].set_xlabel("hour of the simulated day")
    axes[0].legend(fontsize=8)
    axes[0].set_title("Cluster Autoscaler model (sim/autoscaler.py): nodes and pending pods per policy")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


RULES = [
    ("scan every 10 s", "--scan-interval 10 s: section 4 (config/const.go; FAQ)"),
    ("acts only on pods the scheduler marked Unschedulable (every pending pod here: each is tried on arrival and "
     "after every change)", "section 1.1 (listers.go ArrangePodsBySchedulability)"),
    ("no scale-up or scale-down in a loop where the oldest pending pod is < 2 s old or the oldest GPU pod < 30 s",
     "section 1.1 and section 4 (static_autoscaler.go unschedulablePodWithGpuTimeBuffer)"),
    ("pending pods that fit existing or upcoming nodes (in-tree check, consuming capacity in order) are dropped "
     "from scale-up", "section 1.1 (filter_out_schedulable.go), 1.5 (upcoming nodes)"),
    ("in-tree check only: NodeUnschedulable, TaintToleration, NodeAffinity (nodeSelector + required affinity), "
     "NodeResourcesFit (GPU / replica count, pods); never the extender", "section 1.2 (plugin_runner.go; #5708)"),
    ("scale-up: first-fit binpacking of the remaining pods onto template nodes of each group (capped by max size); "
     "expander least-waste scores CPU/memory only, which ties on GPU-only requests: ties broken by most pods helped, "
     "then fewest nodes, then cheapest (ASSUMED relative prices), one group per loop",
     "section 1.3 (expander/waste/waste.go), section 4 (binpacking)"),
    ("new nodes usable after 5 min; starting nodes count as upcoming capacity (< 15 min)",
     "section 4 provisioning times (GCE 3-4 min, AKS A100 5-10 min), MaxNodeStartupTime (clusterstate.go)"),
    ("scale-down candidate: GPU request ratio < 0.5 (CPU/memory ignored), above the group's min size, every pod "
     "movable to other ready nodes by the in-tree check", "section 1.5 (utilization/info.go), 1.7, 1.8"),
    ("removed after 10 min unneeded (the unneeded clock also runs during the cooldown, as in static_autoscaler.go "
     "RunOnce: our reading, not in the reference); not within 10 min after a scale-up nor in a loop that scaled up; "
     "empty nodes in bulk (<= 10), non-empty "
     "one at a time", "section 4 (--scale-down-unneeded-time, -delay-after-add, --max-scale-down-parallelism, "
     "--max-drain-parallelism), 1.8"),
    ("drain: taint and evict; evicted pods are re-created pending at once (5 s taint wait and grace period not "
     "modelled) and resume their remaining work", "section 1.8"),
    ("blocking pods modelled: notebooks carry cluster-autoscaler.kubernetes.io/safe-to-evict: \"false\"; every pod "
     "has a controller and no local volume; PDBs and kube-system pods not modelled", "section 1.7"),
]


def seeds_table(first: int, results: Mapping[str, Mapping[str, Any]],
                others: Mapping[int, Mapping[str, Mapping[str, Any]]]) -> str:
    """Node-hours / GB/s / stuck per policy and seed, and the mean over the seeds."""
    runs = {first: results, **others}
    names = list(results)
    rows = []
    for name in names:
        cells = [f"{r[name]['gpu_node_hours']:.1f} / {r[name]['multi_gpu_pod_gbps_mean']:.1f} / "
                 f"{r[name]['stuck_pods']}" for r in runs.values()]
        hours = statistics.fmean(r[name]["gpu_node_hours"] for r in runs.values())
        gbps = statistics.fmean(r[name]["multi_gpu_pod_gbps_mean"] for r in runs.values())
        rows.append([name, *cells, f"{hours:.1f} / {gbps:.1f}"])
    return markdown_table(["policy", *[f"seed {s}" for s in runs], "mean node-h / GB/s"], rows)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--hours", type=float, default=24.0, help="simulated time (default 24)")
    parser.add_argument("--seed", type=int, default=20261203)
    parser.add_argument("--out", default="autoscale", help="results file stem under bench/results")
    parser.add_argument("--quick", action="store_true", help="3 simulated hours, print only (files too with --out)")
    parser.add_argument("--more-seeds", type=int, default=2,
                        help="also run seeds 1..N and report node-hours and bandwidth per seed (default 2)")
    args = parser.parse_args(argv)
    hours = 3.0 if args.quick else args.hours
    started = time.time()
    works = trace(args.seed, hours)
    results: dict[str, dict[str, Any]] = {}
    series: dict[str, Stats] = {}
    for spec in policies():
        t0 = time.time()
        st = Sim(spec, works, hours, args.seed).run()
        series[spec.name], results[spec.name] = st, summary(st)
        print(f"  {spec.name}: {time.time() - t0:.1f} s", flush=True)
    tab = table(results)
    print(tab)
    others: dict[int, dict[str, dict[str, Any]]] = {}
    for seed in range(1, 0 if args.quick else args.more_seeds + 1):
        more = trace(seed, hours)
        others[seed] = {spec.name: summary(Sim(spec, more, hours, seed).run()) for spec in policies()}
    seeds_tab = seeds_table(args.seed, results, others) if others else ""
    if seeds_tab:
        print(seeds_tab)
    if args.quick and "--out" not in (argv if argv is not None else sys.argv[1:]):
        return
    cmd = "python -m bench.autoscale" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    counts: dict[str, int] = {}
    for w in works:
        counts[w.kind] = counts.get(w.kind, 0) + 1
    load = ", ".join(f"{v} {k} arrivals" for k, v in counts.items())
    groups = "; ".join(f"`{g.name}`: {g.fixture} ("
                       + (f"time-sliced, {g.replicas} replicas per GPU, " if g.replicas else "")
                       + f"min {g.min_size}, max {g.max_size}, relative price {g.price})" for g in GROUPS)
    text = [
        "# Cluster Autoscaler and GPU placement over a day\n",
        f"`{cmd}` (seed {args.seed}, {hours:g} h) on {machine_line()}; run time {time.time() - started:.0f} s.\n",
        f"Node groups: {groups}. Topologies from fixtures/topologies.\n",
        f"Load: {load} ({sum(w.pods for w in works)} pods). Peak arrivals per hour: "
        + ", ".join(f"{k} {v:g}" for k, v in PEAK_RATES.items())
        + "; scaled by a diurnal factor (0.1 at night, 1 at 13:00). Training jobs: 2-4 pods of 8 or 4 GPUs, half "
        "with require-nvlink; Katib bursts of 8-24 single-GPU trials; single pods of 2/4/8 GPUs, 30 % require-nvlink, "
        f"25 % min-allreduce-gbps {MIN_GBPS:g}; inference: 1 time-sliced replica; notebooks: 1 replica (60 %) or 1 "
        "GPU, safe-to-evict \"false\". Pods request only GPUs.\n",
        "## The autoscaler model (sim/autoscaler.py), sources in docs/reference/autoscaling.md\n",
        markdown_table(["rule", "source"], RULES),
        "\n## Policies\n",
        "- `default`: in-tree filters, NodeResourcesFit LeastAllocated on the GPU request ratio (stand-in for the "
        "CPU/memory GPU pods request in proportion), ties at random; GPUs by `gputopo.core.best_subset` (NVIDIA's "
        "plugin); pods of a job one by one, no gang.\n"
        "- `most-allocated`: the same with MostAllocated.\n"
        "- `most-allocated + affinity`: the same, pods carrying the node affinity below (what a team pinning NVLink "
        "pods to NVLink nodes by hand would get).\n"
        "- `ours before` / `ours before + affinity` / `ours`: in-tree filters, then "
        "`extender.placement.engine.Placement` filter/score/choose for single pods (ties: kube-scheduler's "
        "NodeResourcesFit, LeastAllocated before, MostAllocated as the chart now configures it), "
        "`extender.jobs.planner.plan_job` for a job "
        "whose pods are all pending (gang; an evicted pod of a running job is placed alone by the engine); "
        "time-sliced pods by LeastAllocated (the engine's replica path is not driven). With affinity nodes carry "
        f"`{DEFAULT_KEYS.fabric_label}` and `{DEFAULT_KEYS.allreduce_label(0)[:-1]}<k>` labels (templates too) and "
        "pods with require-nvlink / min-allreduce-gbps carry the matching required node affinity; without it CA "
        "sees GPU counts only. `ours before` has `ExtenderConfig(consolidate=False)`, `ours` the default.\n"
        "- `kai-consolidate`: left out. A fair model of KAI's Consolidate action (which pods it moves, when, and "
        "how it interacts with CA's own scale-down) did not fit the time given.\n",
        "## Results\n",
        tab,
        "\nGB/s: `gputopo.core.allreduce_gbps` of each multi-GPU pod's GPUs; jobs: `gputopo.core.jobs."
        "job_allreduce_gbps` over the job's pods (NIC rates from the fixtures, all nodes in one rack). Pending: "
        "per placement (re-placements after eviction included); pods still pending at the end are not in the "
        "means. Stuck: pending > 40 s (30 s GPU wait + one scan), while CA's in-tree packing puts it on a ready "
        "node the policy refused and no pod of its job waits for a new or starting node (a job waiting for "
        "nodes CA is adding is not stuck); counted per scan (10 s). Job pending: first pod created to last pod "
        "placed.\n",
        *([f"\nThe same day with other seeds (GPU node-hours, mean all-reduce GB/s of multi-GPU pods, pods stuck "
            f"while CA believed they fit):\n\n{seeds_tab}"] if seeds_tab else []),
        "## Reading\n",
        reading(results),
        f"\n![nodes and pending pods]({args.out}.png)\n",
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(series, str(RESULTS / f"{args.out}.png"))
    (RESULTS / f"{args.out}.md").write_text("\n".join(text))
    (RESULTS / f"{args.out}.json").write_text(json.dumps(
        {"command": cmd, "seed": args.seed, "hours": hours, "machine": machine_line(), "results": results,
         "other_seeds": {str(k): v for k, v in others.items()}},
        indent=2, default=lambda v: None) + "\n")


def reading(results: Mapping[str, dict[str, Any]]) -> str:
    """Statements read off the figures, nothing more."""
    lines = []
    names = list(results)
    lo = min(names, key=lambda n: results[n]["gpu_node_hours"])
    hi = max(names, key=lambda n: results[n]["gpu_node_hours"])
    lines.append(f"- GPU node-hours range from {results[lo]['gpu_node_hours']:.1f} (`{lo}`) to "
                 f"{results[hi]['gpu_node_hours']:.1f} (`{hi}`).")
    for n in names:
        s = results[n]
        lines.append(f"- `{n}`: {s['stuck_pods']} pods stuck while CA believed they fit "
                     f"({s['stuck_pod_hours']:.2f} pod-hours); {s['pending_at_end']} pods pending at the end; "
                     f"multi-GPU pods {_f(s['multi_gpu_pod_gbps_mean'])} GB/s, jobs {_f(s['job_gbps_mean'])} GB/s "
                     f"on average; {s['evictions']} evictions.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
