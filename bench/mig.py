"""MIG churn: `python -m bench.mig [--requests N] [--nodes N] [--load L] [--seed S]`.

A seeded discrete-event simulation of a fleet of 8-GPU nodes, half HGX H200 (one NVSwitch island) and half
PCIe H100-80GB with NVLink bridge pairs (islands of two), where about half the GPUs are MIG-enabled with mixed
static layouts (all-1g, all-balanced, 2x 3g, 4g + 3g, 4x 1g double memory, 3x 2g, one 7g). Requests arrive
(Poisson) and leave (exponential durations): 70 % ask for 1-3 MIG instances of one profile (every profile of
the node's model, +me included), 30 % for 1, 2, 4 or 8 whole GPUs. A request waits (retried after each
departure, without head-of-line blocking) and gives up after `--patience` mean durations.

What both policies share, so that only the MIG choice differs: the fleet is modelled as the DRA driver's
partitionable devices (docs/reference/gpu-sharing.md §4.2) expose it: a MIG GPU with no instance in use may be
taken whole by a whole-GPU pod, and an idle MIG GPU is re-partitioned to the asked profile (as mig-parted's
all-<profile> layout) when no free instance of it is left. Whole-GPU pods take the first node with enough free
GPUs, plain GPUs before idle MIG GPUs, lowest index first.

Policies for MIG requests:
  first-fit: over NVIDIA's mixed-strategy resources, the first node with enough free instances, and the first
             free instances by GPU index and start (the kubelet's order), as the issue names the baseline.
  random-fit: what kube-scheduler's defaults do with those resources: extended resources do not enter the
             default scoring (NodeResourcesFit scores cpu and memory), so among the feasible nodes the tie is
             broken at random; then the first free instances.
  core:      gputopo.core.mig_placement.choose_mig on every node; the node whose choice has the best key.
  extender:  the extender's own code, as its verbs run it (extender.placement.engine.Placement over a NodeCache
             fed the nodes' published `mig` state): filter, prioritize, the best score (lowest node on ties), and
             bind's choice of instances on it. A GPU held whole is published in the state's "used" (and each MIG
             GPU's NVLink island peers), a MIG GPU held whole not as MIG, as the plugin would publish them.
An idle MIG GPU is re-partitioned only when that lets the request in (enough idle GPUs on one node).

Reported: requests served; requests that waited while enough free slices existed (on one node: k x the
profile's memory slices in unused instances, or 8 n for n whole GPUs, i.e. the wait came from fragmentation);
GPUs left whole (time-average of GPUs with nothing in use); re-partitions; the policy call's p50/p99.
Numbers go to stdout and bench/results/mig.md.
"""

from __future__ import annotations

import argparse
import heapq
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from bench.common import RESULTS, machine_line, markdown_table, percentile
from extender.config import ExtenderConfig
from extender.placement.engine import Placement as ExtenderPlacement
from extender.placement.mig import MigChoiceOnNode
from extender.state.cache import NodeCache, make_entry
from extender.state.mig import node_mig
from extender.state.pods import Need
from extender.state.reservations import Reservations
from gputopo.contract import mig_resource
from gputopo.core.codec import Mig, MigGpuInfo, MigInstance
from gputopo.core.mig import H100_80GB, H200_141GB, MigProfile, Placement, ProfileTable
from gputopo.core.mig_placement import MigChoice, MigGpuState, MigSlot, choose_mig, first_fit, islands_busy

MIG_SHARE = 0.7
MIG_COUNTS = ((1, 0.8), (2, 0.15), (3, 0.05))
WHOLE_SIZES = ((1, 0.4), (2, 0.3), (4, 0.2), (8, 0.1))
# Static layouts as (profile index in the table: 0 1g, 1 1g+me, 2 1g double memory, 3 2g, 4 3g, 5 4g, 6 7g, start)
LAYOUTS: dict[str, list[tuple[int, int]]] = {
    "all-1g": [(0, s) for s in range(7)],
    "all-balanced": [(0, 0), (0, 1), (3, 2), (4, 4)],
    "2x3g": [(4, 0), (4, 4)],
    "4g+3g": [(5, 0), (4, 4)],
    "4x1g-double": [(2, s) for s in (0, 2, 4, 6)],
    "3x2g+1g": [(3, 0), (3, 2), (3, 4), (0, 6)],
    "me+6x1g": [(1, 0), *[(0, s) for s in range(1, 7)]],
    "7g": [(6, 0)],
}


@dataclass
class Gpu:
    index: int
    numa: int
    island: int
    slots: list[MigSlot] | None  # None: a plain GPU
    whole_by: int | None = None  # the request holding it whole

    def idle(self) -> bool:
        return self.whole_by is None and (self.slots is None or not any(s.used for s in self.slots))


@dataclass
class Node:
    index: int
    table: ProfileTable
    gpus: list[Gpu]

    def mig_states(self) -> list[MigGpuState]:
        return [MigGpuState(g.index, g.numa, g.island, tuple(g.slots)) for g in self.gpus
                if g.slots is not None and g.whole_by is None]

    def busy_islands(self, states: Sequence[MigGpuState]) -> frozenset[int]:
        return islands_busy(states, [g.island for g in self.gpus if g.whole_by is not None])

    def free_slices(self) -> int:
        out = 0
        for g in self.gpus:
            if g.whole_by is not None:
                continue
            if g.slots is None:
                out += 8
            else:
                used = sum(s.placement.size for s in g.slots if s.used)
                out += 8 - used
        return out


@dataclass(frozen=True)
class Request:
    id: int
    arrive: float
    duration: float
    model: str | None  # None: whole GPUs (any model)
    profile: str | None
    count: int


def _slots(node: int, gpu: int, table: ProfileTable, layout: list[tuple[int, int]], gen: int) -> list[MigSlot]:
    out = []
    for k, (pi, start) in enumerate(layout):
        p = table.profiles[pi]
        out.append(MigSlot(f"MIG-{node}-{gpu}-{gen}-{k}", p.name, Placement(start, p.memory_slices)))
    return out


def build_fleet(n: int, rng: random.Random) -> list[Node]:
    nodes = []
    names = list(LAYOUTS)
    for i in range(n):
        table = H200_141GB if i % 2 == 0 else H100_80GB
        gpus = []
        for k in range(8):
            island = 0 if table is H200_141GB else k // 2
            mig = k >= 4 if i % 4 < 2 else k % 2 == 1  # half the GPUs MIG, placed differently on alternate nodes
            slots = _slots(i, k, table, LAYOUTS[rng.choice(names)], 0) if mig else None
            gpus.append(Gpu(k, k // 4, island, slots))
        nodes.append(Node(i, table, gpus))
    return nodes


def _weighted(rng: random.Random, pairs: Sequence[tuple[int, float]]) -> int:
    return rng.choices([v for v, _ in pairs], [w for _, w in pairs])[0]


def make_requests(count: int, nodes: int, load: float, rng: random.Random) -> list[Request]:
    tables = (H200_141GB, H100_80GB)
    mean_mig = sum(c * w for c, w in MIG_COUNTS) * sum(p.memory_slices for p in H200_141GB.profiles) / 7
    mean_whole = sum(s * w for s, w in WHOLE_SIZES) * 8
    demand = MIG_SHARE * mean_mig + (1 - MIG_SHARE) * mean_whole  # memory slices per request
    rate = load * nodes * 64 / demand  # arrivals per mean duration
    out, t = [], 0.0
    for i in range(count):
        t += rng.expovariate(rate)
        duration = rng.expovariate(1.0)
        if rng.random() < MIG_SHARE:
            table = rng.choice(tables)
            p = rng.choice(table.profiles)
            out.append(Request(i, t, duration, table.model, p.name, _weighted(rng, MIG_COUNTS)))
        else:
            out.append(Request(i, t, duration, None, None, _weighted(rng, WHOLE_SIZES)))
    return out


Policy = Callable[[list[Node], Request, list[float], random.Random], tuple[Node, MigChoice] | None]


def core_policy(
    nodes: list[Node], req: Request, timings: list[float], rng: random.Random
) -> tuple[Node, MigChoice] | None:
    """choose_mig on every node; the best key wins (lowest node on ties)."""
    best: tuple[tuple, Node, MigChoice] | None = None
    for node in nodes:
        if node.table.model != req.model:
            continue
        states = node.mig_states()
        busy = node.busy_islands(states)
        t0 = time.perf_counter()
        choice = choose_mig(states, req.profile or "", req.count, islands_in_use=busy)
        timings.append(time.perf_counter() - t0)
        if choice is None:
            continue
        rank = (*choice.key, node.index)
        if best is None or rank < best[0]:
            best = (rank, node, choice)
    return (best[1], best[2]) if best else None


class ExtenderPolicy:
    """The extender's placement of a MIG pod over the sim's fleet, through the same objects its verbs use. Each
    node is published as the plugin would (its MIG GPUs not held whole, each instance advertised as
    `nvidia.com/mig-<profile>` under NVIDIA's mixed strategy, held or not) and re-published when it changed. One
    timing per decision: filter + prioritize over the nodes asked, and bind's choice on the winner."""

    def __init__(self) -> None:
        self.cache = NodeCache(ExtenderConfig(), Reservations(300.0))
        self.placement = ExtenderPlacement(self.cache)
        self._published: dict[int, tuple] = {}

    @staticmethod
    def _name(node: Node) -> str:
        return f"node-{node.index}"

    def _publish(self, node: Node) -> None:
        gpus = [g for g in node.gpus if g.slots is not None and g.whole_by is None]
        held = frozenset(self._id(node, g) for g in node.gpus if g.whole_by is not None)
        seen = (held, tuple((g.index, tuple((s.uuid, s.used) for s in g.slots or ())) for g in gpus))
        if self._published.get(node.index) == seen:
            return
        self._published[node.index] = seen
        mig = Mig("mixed", None, tuple(
            MigGpuInfo(self._id(node, g), g.index, g.numa, g.island, node.table.model, tuple(
                MigInstance(s.profile, s.placement.start, s.placement.size, s.uuid, mig_resource(s.profile), s.used)
                for s in g.slots or ()), tuple(self._id(node, p) for p in node.gpus
                                               if p.island == g.island and p is not g)) for g in gpus))
        self.cache.put_node(make_entry(self._name(node), None, problem="whole GPUs are placed by the sim",
                                       used=held, mig=node_mig(mig)))

    @staticmethod
    def _id(node: Node, gpu: Gpu) -> str:
        return f"GPU-{node.index}-{gpu.index}"

    def __call__(self, nodes: list[Node], req: Request, timings: list[float], rng: random.Random
                 ) -> tuple[Node, MigChoice] | None:
        for node in nodes:
            self._publish(node)
        by_name = {self._name(n): n for n in nodes}
        names = list(by_name)
        resource = mig_resource(req.profile or "")
        need = Need(req.count, resource=resource)
        t0 = time.perf_counter()
        passed = self.placement.filter(names, need).passed
        chosen = None
        if passed:
            scores = self.placement.score(passed, need)
            top = max(scores)
            name = passed[scores.index(top)]
            chosen = (name, self.placement.choose_mig(self.cache.nodes[name], resource, need))
        timings.append(time.perf_counter() - t0)
        if chosen is None:
            return None
        name, c = chosen
        assert isinstance(c, MigChoiceOnNode)
        return by_name[name], MigChoice(c.uuids, c.gpus, c.key)


def _first_fits(nodes: list[Node], req: Request, timings: list[float]) -> Iterator[tuple[Node, MigChoice]]:
    """Each node of the request's model with its first-fit choice, in node order, timing every call (lazily: a
    policy that takes the first stops asking)."""
    for node in nodes:
        if node.table.model != req.model:
            continue
        states = node.mig_states()
        t0 = time.perf_counter()
        choice = first_fit(states, req.profile or "", req.count)
        timings.append(time.perf_counter() - t0)
        if choice is not None:
            yield node, choice


def first_fit_policy(
    nodes: list[Node], req: Request, timings: list[float], rng: random.Random
) -> tuple[Node, MigChoice] | None:
    return next(_first_fits(nodes, req, timings), None)


def random_fit_policy(
    nodes: list[Node], req: Request, timings: list[float], rng: random.Random
) -> tuple[Node, MigChoice] | None:
    feasible = list(_first_fits(nodes, req, timings))
    return rng.choice(feasible) if feasible else None


def _idle_mig(node: Node, prefer_busy_islands: bool) -> list[Gpu]:
    idle = [g for g in node.gpus if g.slots is not None and g.idle()]
    if not prefer_busy_islands:
        return idle
    busy = node.busy_islands(node.mig_states())
    return sorted(idle, key=lambda g: (g.island not in busy, g.index))


def repartition(node: Node, gpu: Gpu, profile: MigProfile, gen: int) -> None:
    """mig-parted's all-<profile>: as many of the profile as fit, the rest 1g (a GPU is never left half empty)."""
    table = node.table
    layout: list[tuple[int, int]] = []
    used = 0
    pi = table.profiles.index(profile)
    for start in profile.starts[: profile.instance_count]:
        mask = ((1 << profile.memory_slices) - 1) << start
        if not mask & used and sum(table.profiles[i].compute_slices for i, _ in layout) + profile.compute_slices <= 7:
            layout.append((pi, start))
            used |= mask
    for start in range(7):
        if not (1 << start) & used and sum(table.profiles[i].compute_slices for i, _ in layout) < 7:
            layout.append((0, start))
            used |= 1 << start
    gpu.slots = _slots(node.index, gpu.index, table, layout, gen)


@dataclass
class Sim:
    nodes: list[Node]
    policy: Policy
    prefer_busy_islands: bool
    rng: random.Random
    timings: list[float] = field(default_factory=list)
    spread: list[tuple[int, bool]] = field(default_factory=list)  # per multi-instance request: GPUs, one NUMA node
    held: dict[int, list[tuple[Node, Gpu, str | None]]] = field(default_factory=dict)
    repartitions: int = 0

    def place(self, req: Request) -> bool:
        if req.profile is None:
            return self._place_whole(req)
        found = self.policy(self.nodes, req, self.timings, self.rng)
        if found is None:
            found = self._after_repartition(req)
        if found is None:
            return False
        node, choice = found
        taken = set(choice.uuids)
        hold = []
        for g in node.gpus:
            if g.slots is None:
                continue
            for k, s in enumerate(g.slots):
                if s.uuid in taken:
                    g.slots[k] = MigSlot(s.uuid, s.profile, s.placement, True)
                    hold.append((node, g, s.uuid))
        assert len(hold) == req.count
        self.held[req.id] = hold
        if req.count > 1:
            self.spread.append((len({g.index for _, g, _ in hold}), len({g.numa for _, g, _ in hold}) == 1))
        return True

    def _after_repartition(self, req: Request) -> tuple[Node, MigChoice] | None:
        """Re-partition idle GPUs of the first node where that surely lets the request in; else change nothing."""
        for node in self.nodes:
            if node.table.model != req.model:
                continue
            profile = node.table.by_name(req.profile or "")
            per_gpu = 1 if profile.media_extensions else profile.instance_count
            have = sum(len(s.free(profile.name)) for s in node.mig_states())
            idle = [g for g in _idle_mig(node, self.prefer_busy_islands)
                    if not any(s.profile == profile.name for s in g.slots or ())]
            need = -(-(req.count - have) // per_gpu)
            if need > len(idle):
                continue
            for gpu in idle[:need]:
                self.repartitions += 1
                repartition(node, gpu, profile, self.repartitions)
            found = self.policy([node], req, self.timings, self.rng)
            assert found is not None
            return found
        return None

    def _place_whole(self, req: Request) -> bool:
        for node in self.nodes:
            free = [g for g in node.gpus if g.slots is None and g.whole_by is None]
            free += [g for g in node.gpus if g.slots is not None and g.idle()]
            if len(free) >= req.count:
                hold = []
                for g in free[: req.count]:
                    g.whole_by = req.id
                    hold.append((node, g, None))
                self.held[req.id] = hold
                return True
        return False

    def release(self, req_id: int) -> None:
        for _, g, uuid in self.held.pop(req_id, []):
            if uuid is None:
                g.whole_by = None
                continue
            assert g.slots is not None
            for k, s in enumerate(g.slots):
                if s.uuid == uuid:
                    g.slots[k] = MigSlot(s.uuid, s.profile, s.placement, False)

    def room_for(self, req: Request) -> bool:
        """Enough free slices on one node, whatever instances they are cut into (so a wait is fragmentation)."""
        need = req.count * 8 if req.profile is None else req.count * self._slices(req)
        return any(n.free_slices() >= need for n in self.nodes if req.model in (None, n.table.model))

    def _slices(self, req: Request) -> int:
        table = H200_141GB if req.model == H200_141GB.model else H100_80GB
        return table.by_name(req.profile or "").memory_slices

    def idle_gpus(self) -> int:
        return sum(1 for n in self.nodes for g in n.gpus if g.idle())


def simulate(
    requests: list[Request], nodes: list[Node], policy: Policy, prefer: bool, patience: float, seed: int
) -> dict:
    sim = Sim(nodes, policy, prefer, random.Random(seed))
    events: list[tuple[float, int, int, int]] = []  # (time, kind 0 departure / 1 arrival, seq, request id)
    for r in requests:
        heapq.heappush(events, (r.arrive, 1, r.id, r.id))
    by_id = {r.id: r for r in requests}
    pending: list[Request] = []
    waited: set[int] = set()
    waited_with_room: set[int] = set()
    mig_ids = {r.id for r in requests if r.profile is not None}
    served = 0
    idle_area = 0.0
    last_t = 0.0
    seq = len(requests)

    served_mig = 0

    def start(req: Request, now: float) -> None:
        nonlocal served, seq, served_mig
        served += 1
        served_mig += req.profile is not None
        seq += 1
        heapq.heappush(events, (now + req.duration, 0, seq, req.id))

    while events:
        now, kind, _, rid = heapq.heappop(events)
        idle_area += sim.idle_gpus() * (now - last_t)
        last_t = now
        if kind == 0:
            sim.release(rid)
            still = []
            for req in pending:
                if now - req.arrive > patience:
                    continue  # gave up
                if sim.place(req):
                    start(req, now)
                else:
                    if sim.room_for(req):
                        waited_with_room.add(req.id)
                    still.append(req)
            pending = still
            continue
        req = by_id[rid]
        if sim.place(req):
            start(req, now)
        else:
            waited.add(req.id)
            if sim.room_for(req):
                waited_with_room.add(req.id)
            pending.append(req)
    ms = [t * 1000 for t in sim.timings]
    return {
        "served": served,
        "gave_up": len(requests) - served,
        "gave_up_mig": len(mig_ids) - served_mig,
        "waited": len(waited),
        "waited_mig": len(waited & mig_ids),
        "waited_with_room": len(waited_with_room),
        "waited_with_room_mig": len(waited_with_room & mig_ids),
        "idle_gpus_mean": idle_area / last_t if last_t else 0.0,
        "repartitions": sim.repartitions,
        "multi_gpus": sum(n for n, _ in sim.spread) / max(1, len(sim.spread)),
        "multi_numa_local": sum(1 for _, local in sim.spread if local) / max(1, len(sim.spread)),
        "p50_ms": percentile(ms, 50),
        "p99_ms": percentile(ms, 99),
        "calls": len(ms),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=6000)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--load", type=float, default=0.9, help="offered load, in memory slices, of the fleet")
    parser.add_argument("--patience", type=float, default=0.5, help="mean durations a request waits, at most")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--seeds", type=int, default=3, help="runs, seeds seed .. seed + seeds - 1")
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/results/mig.md")
    args = parser.parse_args(argv)

    rows = []
    totals: dict[str, dict[str, float]] = {}
    policies: tuple[tuple[str, Callable[[], Policy], bool], ...] = (
        ("first-fit", lambda: first_fit_policy, False), ("random-fit", lambda: random_fit_policy, False),
        ("core", lambda: core_policy, True), ("extender", ExtenderPolicy, True))
    for seed, (name, make_policy, prefer) in ((s, p) for s in range(args.seed, args.seed + args.seeds)
                                              for p in policies):
        policy = make_policy()
        nodes = build_fleet(args.nodes, random.Random(seed))
        requests = make_requests(args.requests, args.nodes, args.load, random.Random(seed + 1))
        r = simulate(requests, nodes, policy, prefer, args.patience, seed + 2)
        tot = totals.setdefault(name, {"served": 0, "waited": 0, "room": 0, "idle": 0.0})
        tot["served"] += r["served"]
        tot["waited"] += r["waited"]
        tot["room"] += r["waited_with_room"]
        tot["idle"] += r["idle_gpus_mean"] / args.seeds
        rows.append([seed, name, f"{r['served']} / {args.requests}", f"{r['gave_up']} ({r['gave_up_mig']})",
                     f"{r['waited']} ({r['waited_mig']})",
                     f"{r['waited_with_room']} ({r['waited_with_room_mig']})",
                     f"{r['idle_gpus_mean']:.1f} / {args.nodes * 8}", r["repartitions"],
                     f"{r['multi_gpus']:.2f}", f"{100 * r['multi_numa_local']:.0f} %",
                     f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}", r["calls"]])
    header = ["seed", "policy", "served", "gave up (MIG)", "waited (MIG)", "waited with room (MIG)",
              "GPUs left whole (mean)",
              "re-partitions", "GPUs per multi-instance request", "multi-instance on one NUMA node",
              "policy call p50 ms", "policy call p99 ms", "calls"]
    table = markdown_table(header, rows)
    n = args.requests * args.seeds
    summary = markdown_table(
        ["policy", f"served of {n}", "waited", "waited with room", "GPUs left whole (mean)"],
        [[k, int(v["served"]), int(v["waited"]), int(v["room"]), f"{v['idle']:.1f}"] for k, v in totals.items()],
    )
    cmd = (f"python -m bench.mig --requests {args.requests} --nodes {args.nodes} --load {args.load} "
           f"--patience {args.patience} --seed {args.seed} --seeds {args.seeds}")
    text = (f"# MIG churn: the extender's placement vs first-fit\n\n`{cmd}` on {machine_line()} (a shared, "
            f"loaded machine: timings are noisy; the policies ran back to back on the same streams).\n\n"
            f"{summary}\n\n{table}\n\n"
            "- served: requests placed before giving up (after --patience mean durations); waited: requests not "
            "placed at arrival; waited with room: "
            "requests that waited while one node had enough free memory slices for them (fragmentation).\n"
            "- GPUs left whole: time-average of GPUs with nothing in use (free for whole-GPU pods or any layout).\n"
            "- policy call: first-fit, random-fit and core: one node's decision (first_fit / choose_mig on that "
            "node's MIG GPUs); extender: one whole decision (filter + prioritize over every node, and bind's "
            "choice on the winner, through extender.placement.engine as the verbs call it). Calls after a "
            "re-partition included.\n"
            "- multi-instance requests (2 or 3 instances): how many GPUs they span (MIG instances have no NVLink "
            "between them) and how many sit on one NUMA node.\n"
            "- (MIG): of those, the MIG requests; the rest are whole-GPU pods, placed by the same rule in every "
            "policy, which wait when the MIG choice has left too few idle GPUs.\n")
    print(text)
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "mig.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
