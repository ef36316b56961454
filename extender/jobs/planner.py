"""Where a whole job should go: nodes and GPUs for every pod still to place, chosen together from a snapshot.

Pure: the caller hands in each node's free GPUs (a bitmask, reservations already taken out), topology and
locality, and the job (pods of k GPUs, members already placed). The answer is the plan with the best estimated job
all-reduce (gputopo.core.jobs) the cluster offers now, then the one spanning the fewest locality levels, then the
least fragmentation: fewest whole free nodes broken, then the fullest racks (best fit: emptier racks stay whole for
larger jobs), then fewest GPUs left stranded on the nodes it touches, then fewest nodes.

How. When the job is small against the free GPUs (at most `_EXACT_LIMIT` ways to put its pods on them), every
way is weighed: the plan is then exact, as the allocator is up to 16 GPUs. Otherwise candidate fills are built
cheaply, each with an upper bound of its estimate that is exact when it stays in one
rack; the job model then weighs the best candidates only, best bound first, until no bound can beat the best
estimate found (at most `_MAX_EVALUATIONS`). The candidates:
- one node for the whole job (its pods then talk over the host path);
- with at most q pods per node (q = 1 spreads, q = the most a node holds packs): every well-ranked rack that holds
  the job, and for each larger domain (spine, zone, cluster) its racks taken best first. Nodes within a rack go
  members first, then by what their pods let a ring reach (min of pod rings and the node's NIC path), then tightest
  fit; racks by members, reach, room. With members, only domains holding them all.
A node's pods for a job spanning nodes are picked with the network in view: a pod takes the GPU with the best NIC
path (an RDMA NIC on its own PCIe switch) when that raises min(pod ring, pod network rate); a one-node job takes the
allocator's best subsets as they are. Nodes of one rack in one state (topology fingerprint, free set) are one bucket
and share every computation, memoised across calls, so a 5,000-node snapshot costs a pass over the nodes and a
little per bucket.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import combinations

from extender.jobs import reasons
from extender.jobs.reasons import literal, noun, plural
from gputopo.core import Topology, best_subset
from gputopo.core.bandwidth import HOST_PATH_GBPS
from gputopo.core.bitset import bits, mask_of
from gputopo.core.jobs import JobEstimate, Limit, PodSlot, job_allreduce_gbps, pod_ring_gbps
from gputopo.core.locality import Locality, Place

MAX_GPUS_PER_POD = 4096
_MEMO_LIMIT = 200_000
_MAX_EVALUATIONS = 8
_RACKS_PER_ORDER = 6
_REL_EPS = 1e-6
_SPLIT_LIMIT = 2000
_SPLIT_VISITS = 20_000
_EXACT_LIMIT = 2_500  # ways to place the remaining pods, below which every way is weighed


class JobPlanError(ValueError):
    """The request cannot be planned as asked (bad sizes, a member on GPUs its node does not have)."""


class JobUnplaceable(Exception):
    """No placement of the job exists on the nodes given; `reason` names the job and the shortfall."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    name: str
    topo: Topology
    free: int  # bitmask of GPU indices free for this job (used, unhealthy and reserved ones taken out)
    place: Place


@dataclass(frozen=True, slots=True)
class Member:
    """A pod of the job already placed (bound, or holding a reservation): its node and GPU indices."""

    node: str
    gpus: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class JobRequest:
    job: str  # for reasons: "ml/train-7"
    gpus_per_pod: int
    size: int | None  # pods in all, members included; None when unknown (then one more pod is planned)
    members: tuple[Member, ...] = ()
    role: str = "worker"
    # the pods' own floors (annotations require-nvlink, min-allreduce-gbps), as the per-pod placement reads them:
    # every planned pod's ring must meet them; members already placed are weighed as they are
    require_nvlink: bool = False
    min_gbps: float = 0.0

    @property
    def constrained(self) -> bool:
        return self.gpus_per_pod > 1 and (self.require_nvlink or self.min_gbps > 0)

    def constraint_text(self) -> str:
        parts = (["require-nvlink"] if self.require_nvlink else []) + (
            [f"min-allreduce {self.min_gbps:g} GB/s"] if self.min_gbps > 0 else [])
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class Slot:
    node: str
    gpus: tuple[int, ...]


@dataclass(frozen=True)
class JobPlan:
    request: JobRequest
    slots: tuple[Slot, ...]  # the pods still to place
    estimate: JobEstimate  # of members and slots together
    where: str  # the smallest domain holding the whole job: "node n7", "rack r12", "the cluster"
    dropped: tuple[str, ...] = ()  # members left out of the estimate, and why
    counts: dict[str, int] = field(default_factory=dict)  # node -> pods of the job there, members included

    @property
    def placed(self) -> int:
        return len(self.request.members) - len(self.dropped)

    @property
    def summary(self) -> str:
        r = self.request
        nodes = ", ".join(f"{n} x{c}" for n, c in sorted(self.counts.items()))
        return reasons.job_says(r.job, f"{self.placed} of {_of(r)} placed, {len(self.slots)} planned; the job on "
                                       f"{{where}} ({{nodes}}), {estimate_text(self.estimate)}",
                                where=self.where, nodes=nodes)

    @property
    def limit_text(self) -> str:
        """What limits the job's estimate: "limited by the network inside one rack", "... by the pod ring"."""
        return limit_text(self.estimate)

    def reason_for(self, node: str) -> str:
        """What filter and prioritize say about a node for the job's next pod."""
        r = self.request
        planned = sum(1 for s in self.slots if s.node == node)
        if planned:
            return reasons.job_says(r.job, f"{self.placed} of {_of(r)} placed, {planned} planned on this node; it "
                                           f"keeps the job on {{where}} ({estimate_text(self.estimate, short=True)})",
                                    where=self.where)
        nodes = sorted({s.node for s in self.slots})
        shown = ", ".join(nodes[:4]) + (f" and {len(nodes) - 4} more" if len(nodes) > 4 else "")
        return reasons.job_says(r.job, "planned on {where} ({shown}); this node is not in the plan",
                                where=self.where, shown=shown)


def _quoted(value: object) -> str:
    """A value a request should not have, quoted short as template words."""
    return literal(repr(value)[:20])


def _of(request: JobRequest) -> str:
    """'4 workers', '1 worker', '? workers' (size unknown)."""
    if request.size is None:
        return f"? {request.role}s"
    return plural(request.size, request.role)


def limit_text(est: JobEstimate) -> str:
    """What limits an estimate: "limited by the network inside one rack", "limited by the pod ring"; for one GPU in
    all (Limit.NONE), that there is no all-reduce (its value, "no collective", is not a limit to name)."""
    if est.limit is Limit.NETWORK:
        return "limited by the network" + (" inside one rack" if est.split < 0 else " between domains")
    if est.limit is Limit.NONE or not getattr(est.limit, "value", None):
        return "no all-reduce"
    return f"limited by the {est.limit.value}"


def estimate_text(est: JobEstimate, short: bool = False) -> str:
    """'est. 12.5 GB/s all-reduce, limited by the host path' (short: without 'all-reduce'); for a job of one GPU in
    all, 'one GPU in all, no all-reduce' rather than an estimate of 0.0 GB/s."""
    if est.limit is Limit.NONE or est.gbps <= 0:
        return "one GPU in all, no all-reduce"
    return f"est. {est.gbps:.1f} GB/s{'' if short else ' all-reduce'}, {limit_text(est)}"


def job_figure(pods: list[PodSlot], locality: Locality) -> tuple[JobEstimate, str, dict[str, int]]:
    """Pods of one job seen together (a plan's, or the ones placed so far): the job's estimate, the smallest domain
    holding them ("node n7", "rack r12", "the cluster") and its pods per node. Raises JobModelError on no pods."""
    estimate = job_allreduce_gbps(pods, locality)
    counts = Counter(p.node for p in pods)
    if len(counts) == 1:
        where = f"node {next(iter(counts))}"
    else:
        where = locality.where(estimate.split, pods[0].place)
    return estimate, where, dict(counts)


def plan_job(request: JobRequest, nodes: Iterable[NodeSnapshot], locality: Locality,
             exact_limit: int = _EXACT_LIMIT) -> JobPlan:
    """The job's plan. Raises JobPlanError on a bad request, JobUnplaceable when it fits nowhere. `exact_limit`:
    the most ways to place the job that are all weighed (0: candidate fills only, as for a large cluster)."""
    k = request.gpus_per_pod
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_GPUS_PER_POD:
        raise JobPlanError(reasons.job_says(request.job, f"{_quoted(k)} GPUs per pod is not a pod size"))
    if request.size is not None and (isinstance(request.size, bool) or request.size < 1):
        raise JobPlanError(reasons.job_says(request.job, f"size {_quoted(request.size)} is not a number of pods"))
    if request.min_gbps < 0 or request.min_gbps != request.min_gbps:
        raise JobPlanError(reasons.job_says(request.job, f"min-allreduce {_quoted(request.min_gbps)} GB/s is not a "
                                                         "floor"))
    snaps = {snap.name: snap for snap in nodes}
    members, dropped = _members(request, snaps)
    remaining = request.size - len(request.members) if request.size is not None else 1
    if remaining <= 0:
        raise JobPlanError(reasons.job_says(request.job, f"all {_of(request)} placed; nothing to plan"))
    buckets, room = _buckets(snaps, k, Counter(m.node for m in members), request)
    if room < remaining:
        floor = f" whose rings meet {request.constraint_text()}" if request.constrained else ""
        raise JobUnplaceable(reasons.job_says(
            request.job, f"needs {remaining} more {noun(remaining, request.role)} of {plural(k, 'GPU')}{floor}, "
                         f"the cluster has room for {room} now" + (f" ({len(members)} placed)" if members else "")))
    member_slots = [PodSlot(m.node, snaps[m.node].topo, m.gpus, snaps[m.node].place) for m in members]
    member_pods: dict[str, list[_Pod]] = {}
    for slot in member_slots:
        ring = pod_ring_gbps(slot.topo, slot.gpus) if len(slot.gpus) > 1 else math.inf
        member_pods.setdefault(slot.node, []).append(_Pod(slot.gpus, ring, slot.network_gbps))
    member_places = {s.node: s.place for s in member_slots}
    exact = _exact(request, snaps, member_slots, remaining, dropped, locality, exact_limit)
    if exact is not None:
        return exact
    candidates = _candidates(buckets, remaining, locality, member_pods, member_places)
    if not candidates:
        raise JobUnplaceable(reasons.job_says(
            request.job, f"no domain holding its {len(members)} placed {noun(len(members), request.role)} has "
                         f"room for {remaining} more of {plural(k, 'GPU')}"))
    best: tuple[tuple, JobPlan] | None = None
    for evaluated, cand in enumerate(sorted(candidates, key=lambda c: c.order)):
        if best is not None and (evaluated >= _MAX_EVALUATIONS or cand.upper < best[0][0] * (1 - _REL_EPS)):
            break
        plan = _plan_of(request, cand.fill, member_slots, dropped, locality)
        if len(plan.slots) != remaining:
            continue  # a node gave fewer pods meeting the ring floor than its bucket counted (a search budget ran out)
        score = (plan.estimate.gbps, *cand.order[1:])
        if best is None or _better(score, best[0]):
            best = (score, plan)
    if best is None:
        raise JobUnplaceable(reasons.job_says(
            request.job, f"no candidate placement gives all {remaining} {noun(remaining, request.role)} rings "
                         f"that meet {request.constraint_text() or 'its floors'}"))
    return best[1]


def _members(request: JobRequest, snaps: dict[str, NodeSnapshot]) -> tuple[list[Member], tuple[str, ...]]:
    members, dropped = [], []
    for m in request.members:
        snap = snaps.get(m.node)
        if snap is None:
            dropped.append(f"{request.role} on {m.node}: node gone")
            continue
        if len(m.gpus) != request.gpus_per_pod:
            raise JobPlanError(reasons.job_says(
                request.job, f"a {request.role} on {{node}} holds {plural(len(m.gpus), 'GPU')}, the job's pods ask "
                             f"{request.gpus_per_pod}", node=m.node))
        if len(set(m.gpus)) != len(m.gpus) or any(not 0 <= g < snap.topo.size for g in m.gpus):
            raise JobPlanError(reasons.job_says(
                request.job, f"a {request.role} on {{node}} holds GPUs {list(m.gpus)!s:.60}, not distinct GPUs of a "
                             f"node with {snap.topo.size}", node=m.node))
        members.append(m)
    return members, tuple(dropped)


# -- pods a node gives -----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Pod:
    gpus: tuple[int, ...]
    ring: float  # inf for a 1-GPU pod
    rate: float


_PODS: dict[tuple[str, int, int, int, bool, float], tuple[_Pod, ...]] = {}
_VALUES: dict[tuple[str, int, int, int, float], float] = {}
_NVLINK_FLOORS: dict[str, float] = {}
_EPS = 1e-9  # as extender.placement.policy: a ring meets a floor unless below it by more than float noise


def ring_floor(topo: Topology, request: JobRequest) -> float:
    """The slowest ring a new pod of the job may have on this topology: its min-allreduce GB/s and, with
    require-nvlink, the node's slowest NVLink pair (a ring at or above it runs on NVLink alone, as the per-pod
    placement reads the annotation); inf on a node without NVLink. 0 for an unconstrained job."""
    if not request.constrained:
        return 0.0
    floor = request.min_gbps
    if request.require_nvlink:
        nv = _NVLINK_FLOORS.get(topo.fingerprint)
        if nv is None:
            n = topo.size
            pairs = [topo.gbps(i, j) for i in range(n) for j in range(i + 1, n) if topo.link(i, j).kind.is_nvlink]
            if len(_NVLINK_FLOORS) >= _MEMO_LIMIT:
                _NVLINK_FLOORS.clear()
            nv = _NVLINK_FLOORS[topo.fingerprint] = min(pairs) if pairs else math.inf
        floor = max(floor, nv)
    return floor


def _pods(topo: Topology, free: int, k: int, c: int, network: bool, floor: float = 0.0) -> tuple[_Pod, ...]:
    """The c pods of k GPUs this free set gives the job, chosen together (memoised): one at a time, best first,
    unless that leaves a weak pod below what a balanced split reaches; then the split with the best
    `_pods_value`, weakest ring and ring total, by branch and bound over disjoint subsets (at most `_SPLIT_LIMIT`
    complete splits looked at). With a ring floor every pod meets it: fewer than c when the free set cannot give
    c such pods (one at a time first; when that falls short, the most disjoint subsets meeting it a search finds)."""
    key = (topo.fingerprint, free, k, c, network, floor)
    hit = _PODS.get(key)
    if hit is not None:
        return hit
    out = _one_by_one(topo, free, k, c, network, floor)
    if c > 1 and len(out) == c and _pods_value(list(out), network) < _ceiling(topo, free, c, network):
        out = _best_split(topo, free, k, c, network, out, floor)
    elif floor > 0 and 0 < len(out) < c:
        for more in range(c, len(out), -1):
            split = _best_split(topo, free, k, more, network, None, floor)
            if split:
                out = split
                break
    if len(_PODS) >= _MEMO_LIMIT:
        _PODS.clear()
    _PODS[key] = out
    return out


def _meets(ring: float, floor: float) -> bool:
    return ring + _EPS >= floor


def _ceiling(topo: Topology, free: int, c: int, network: bool) -> float:
    """No c pods of this free set reach more: the host path between them, and the second-best NIC path."""
    if not network:
        return HOST_PATH_GBPS
    rates = sorted((topo.network_gbps[g] for g in bits(free)), reverse=True)
    return min(HOST_PATH_GBPS, rates[1] if len(rates) > 1 else rates[0])


def _pod(topo: Topology, gpus: tuple[int, ...]) -> _Pod:
    ring = pod_ring_gbps(topo, gpus) if len(gpus) > 1 else math.inf
    return _Pod(gpus, ring, max(topo.network_gbps[g] for g in gpus))


def _one_by_one(topo: Topology, free: int, k: int, c: int, network: bool, floor: float) -> tuple[_Pod, ...]:
    pods: list[_Pod] = []
    left = free
    while len(pods) < c and left.bit_count() >= k:
        avail = bits(left)
        choice = best_subset(topo, avail, k).gpus
        if floor > 0 and not _meets(_pod(topo, choice).ring, floor):
            break  # the allocator's best ring is the fastest these GPUs form: no other pod meets the floor
        if network:
            best_rate = max(topo.network_gbps[g] for g in avail)
            if max(topo.network_gbps[g] for g in choice) < best_rate:
                g = next(g for g in avail if topo.network_gbps[g] == best_rate)
                other = _pod(topo, best_subset(topo, avail, k, must_include=(g,)).gpus)
                pod = _pod(topo, choice)
                if _reach(other) > _reach(pod) and _meets(other.ring, floor):
                    choice = other.gpus
        pods.append(_pod(topo, choice))
        left &= ~mask_of(choice)
    return tuple(pods)


def _reach(pod: _Pod) -> tuple[float, float, float]:
    """How good a pod is for a job that spans nodes: what it reaches itself, then its NIC rate (every edge between
    nodes is that rate times a factor <= 1 for the levels it crosses, while the ring is not scaled), then its ring.
    Rounded: rates and ring figures come from different sums, and float noise must not decide a tie."""
    return round(min(pod.ring, pod.rate), 6), round(pod.rate, 6), round(pod.ring, 6)


def _best_split(topo: Topology, free: int, k: int, c: int, network: bool,
                greedy: tuple[_Pod, ...] | None, floor: float) -> tuple[_Pod, ...]:
    """The best c disjoint pods (greedy: the split to beat, or None to find any); () when the search finds none
    within its budgets: `_SPLIT_LIMIT` complete splits, `_SPLIT_VISITS` partial ones."""
    subsets = sorted((p for p in (_pod(topo, combo) for combo in combinations(bits(free), k)) if _meets(p.ring, floor)),
                     key=lambda p: (-p.ring, p.gpus))
    masks = [mask_of(p.gpus) for p in subsets]
    if greedy is None:
        best: list = [(-math.inf, -math.inf, -math.inf), ()]
    else:
        rings = [p.ring for p in greedy]
        best = [(_pods_value(list(greedy), network), min(rings), sum(rings)), greedy]
    budget = [_SPLIT_LIMIT, _SPLIT_VISITS]

    def search(start: int, used: int, chosen: list[_Pod]) -> None:
        if len(chosen) == c:
            budget[0] -= 1
            chosen_rings = [p.ring for p in chosen]
            score = (_pods_value(chosen, network), min(chosen_rings), sum(chosen_rings))
            if score > best[0]:
                best[0], best[1] = score, tuple(chosen)
            return
        budget[1] -= 1
        for i in range(start, len(subsets) - (c - len(chosen)) + 1):
            if budget[0] <= 0 or budget[1] <= 0 or subsets[i].ring < best[0][0]:
                return  # rings only fall from here: no completion beats the best value
            if not used & masks[i]:
                search(i + 1, used | masks[i], [*chosen, subsets[i]])

    search(0, 0, [])
    return best[1]  # type: ignore[no-any-return]


def _pods_value(pods: list[_Pod], multi: bool) -> float:
    """What these pods of one node let the job reach: their rings, the host path between them, and, when the job
    spans nodes, the node's two ring ends (the best pod's rate to one, the second best's to the other)."""
    value = min(p.ring for p in pods)
    if len(pods) > 1:
        value = min(value, HOST_PATH_GBPS)
    if multi:
        rates = sorted((p.rate for p in pods), reverse=True)
        value = min(value, rates[1] if len(rates) > 1 else rates[0])
    return value


def _value(topo: Topology, free: int, k: int, c: int, multi: bool, floor: float = 0.0) -> float:
    """`_pods_value` of the c pods a free set gives, memoised."""
    key = (topo.fingerprint, free, k, c * 2 + multi, floor)
    hit = _VALUES.get(key)
    if hit is None:
        hit = _pods_value(list(_pods(topo, free, k, c, multi, floor)), multi) if c > 0 else 0.0
        if len(_VALUES) >= _MEMO_LIMIT:
            _VALUES.clear()
        _VALUES[key] = hit
    return hit


# -- buckets of interchangeable nodes ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Bucket:
    """Nodes of one rack in one state (a node holding members is a bucket of its own)."""

    place: Place
    topo: Topology
    free: int
    k: int
    cap: int  # pods each node holds
    members: int  # pods of the job already on the node (member buckets)
    whole: bool  # every GPU free before this job
    free_count: int
    snaps: list[NodeSnapshot]
    floor: float = 0.0  # ring_floor of the job on this topology
    fp: str = ""  # topology fingerprint
    name: str = ""  # first node's name, once sorted

    def __post_init__(self) -> None:
        self.fp = self.topo.fingerprint


def _buckets(snaps: dict[str, NodeSnapshot], k: int, member_count: Counter[str],
             request: JobRequest) -> tuple[list[_Bucket], int]:
    by_state: dict[tuple, _Bucket] = {}
    get = by_state.get
    room = 0
    constrained = request.constrained
    for snap in snaps.values():
        free = snap.free
        count = free.bit_count()
        members = member_count[snap.name] if member_count else 0
        if count < k and not members:
            continue
        topo = snap.topo
        key = (snap.place, topo.fingerprint, free, snap.name if members else None)
        bucket = get(key)
        if bucket is None:
            cap, floor = count // k, 0.0
            if constrained and cap:  # the pods of the free set that meet the floor
                floor = ring_floor(topo, request)
                cap = len(_pods(topo, free, k, cap, False, floor)) if floor < math.inf else 0
            if cap == 0 and not members:
                continue
            bucket = by_state[key] = _Bucket(snap.place, topo, free, k, cap, members, count == topo.size,
                                             count, [snap], floor)
        else:
            bucket.snaps.append(snap)
        room += bucket.cap
    buckets = list(by_state.values())
    for b in buckets:
        if len(b.snaps) > 1:
            b.snaps.sort(key=lambda s: s.name)
        b.name = b.snaps[0].name
    return buckets, room


# -- candidate fills -------------------------------------------------------------------------------------------

# (bucket, node, new pods there, pods picked with the network in view)
Fill = list[tuple[_Bucket, NodeSnapshot, int, bool]]
Entry = tuple[tuple, _Bucket, int, float]  # (sort key, bucket, pods per node at most, network value for them)


@dataclass(slots=True)
class _Candidate:
    fill: Fill
    upper: float  # the model's estimate when the fill stays in one rack, an upper bound otherwise
    order: tuple  # (-upper, split, whole nodes broken, GPUs its racks keep free, GPUs stranded, nodes): best first


def _candidates(buckets: list[_Bucket], remaining: int, locality: Locality, member_pods: dict[str, list[_Pod]],
                member_places: dict[str, Place]) -> list[_Candidate]:
    out: list[_Candidate] = []
    rack_free: dict[Place, int] = {}
    for b in buckets:
        rack_free[b.place] = rack_free.get(b.place, 0) + b.free_count * len(b.snaps)
    single = _single_host(buckets, remaining, member_pods)
    if single is not None:
        out.append(_candidate([(single, single.snaps[0], remaining, False)], locality, member_pods, member_places,
                               rack_free))
    spread_racks, spread_ranks = _ranked_racks(buckets, 1, remaining)
    passes = [(spread_racks, spread_ranks)]
    reach = max((-r[1] for r in spread_ranks.values() if r[2] <= -remaining), default=0.0)
    # a pass with q >= 2 puts two pods on a node somewhere, which caps it at the host path: when one rack already
    # reaches beyond that spreading, packing cannot win
    if member_pods or reach <= HOST_PATH_GBPS * (1 + _REL_EPS):
        most = max(b.cap + b.members for b in buckets)
        passes += [_ranked_racks(buckets, q, remaining) for q in sorted({2, most} - {0, 1})]
    for racks, ranks in passes:
        ordered = sorted(racks, key=ranks.__getitem__)
        for level in range(len(locality.levels) + 1):
            for fill in _domain_fills(racks, ordered, ranks, level, remaining, member_places, spread_racks,
                                      rack_free):
                out.append(_candidate(fill, locality, member_pods, member_places, rack_free))
    return out


def _single_host(buckets: list[_Bucket], remaining: int, member_pods: dict[str, list[_Pod]]) -> _Bucket | None:
    if len(member_pods) > 1:
        return None
    hosts = [b for b in buckets if b.cap >= remaining and (b.members > 0 or not member_pods)]
    if not hosts:
        return None
    return min(hosts, key=lambda b: (-_value(b.topo, b.free, b.k, remaining, False, b.floor), b.free_count, b.name))


def _ranked_racks(buckets: list[_Bucket], q: int,
                  remaining: int) -> tuple[dict[Place, list[Entry]], dict[Place, tuple]]:
    """With at most q pods per node: each rack's buckets that can take a pod, best first (members; then, spreading,
    what the node's pods let a ring reach, packing, the most pods; then the tightest fit), and each rack's rank."""
    racks: dict[Place, list[Entry]] = {}
    values = _VALUES
    for b in buckets:
        c = min(b.cap, q - b.members)
        if c <= 0:
            continue
        value = values.get((b.fp, b.free, b.k, c * 2 + 1, b.floor))
        if value is None:
            value = _value(b.topo, b.free, b.k, c, True, b.floor)
        left = b.free_count - c * b.k
        key = (-b.members, -value, left, b.name) if q == 1 else (-b.members, -c, -value, left, b.name)
        entries = racks.get(b.place)
        if entries is None:
            racks[b.place] = [(key, b, c, value)]
        else:
            entries.append((key, b, c, value))
    ranks = {}
    for place, entries in racks.items():
        entries.sort(key=_first)
        ranks[place] = _rack_rank(entries, remaining)
    return racks, ranks


def _first(entry: Entry) -> tuple:
    return entry[0]


def _rack_rank(entries: list[Entry], remaining: int) -> tuple:
    """(members, reach, room, name, GPUs its fill would leave): racks holding members first, then those whose best
    nodes reach furthest for the job, then the roomiest; the last field says how tight its fill is."""
    members = capacity = left = 0
    value = math.inf
    for _, b, c, v in entries:
        members += b.members
        nodes = len(b.snaps)
        if capacity < remaining:
            value = min(value, v)
            taken = min(nodes * c, remaining - capacity)
            left += min(nodes, -(-(remaining - capacity) // c)) * b.free_count - taken * b.k
        capacity += nodes * c
    return (-members, -value, -capacity, entries[0][1].name, left)


def _domain_fills(racks: dict[Place, list[Entry]], ordered: list[Place], ranks: dict[Place, tuple], level: int,
                  remaining: int, member_places: dict[str, Place], spread: dict[Place, list[Entry]],
                  rack_free: dict[Place, int]) -> Iterable[Fill]:
    """At level 0 one fill per rack that holds the job: the best ranked racks, and of those reaching as far the
    tightest fills and the fullest racks; above, per domain, its racks best first. With members, only the domain
    holding them all."""
    if level == 0 and not member_places:
        fitting = [p for p in ordered if -ranks[p][2] >= remaining]
        reach = ranks[fitting[0]][1] if fitting else 0.0
        best = [p for p in fitting if ranks[p][1] == reach]
        tight = sorted(best, key=lambda p: ranks[p][4])
        full = sorted(best, key=lambda p: (rack_free.get(p, 0), p))
        ordered = list(dict.fromkeys(fitting[:_RACKS_PER_ORDER] + tight[:_RACKS_PER_ORDER] + full[:_RACKS_PER_ORDER]))
    domains: dict[Place, list[Place]] = {}
    for place in ordered:
        domains.setdefault(place[level:], []).append(place)
    if member_places:
        keys = {p[level:] for p in member_places.values()}
        if len(keys) != 1:
            return
        key = keys.pop()
        domains = {key: domains[key]} if key in domains else {}
    for group in domains.values():
        if level > 0 and len(group) == 1:
            continue  # the same nodes as the domain one level down
        fill = _take((e for place in group for e in racks[place]),
                     (e for place in group for e in spread.get(place, ())), remaining)
        if fill:
            yield fill


def _take(entries: Iterable[Entry], spread: Iterable[Entry], remaining: int) -> Fill:
    """Nodes in order, each taking as many pods as it may; once fewer pods are left than the next node would
    take, the rest go one per node to the best-reaching nodes not yet used (a packing fill's remainder)."""
    fill: Fill = []
    need = remaining
    for _, b, most, _ in entries:
        for snap in b.snaps:
            if need < most:
                return _rest(fill, spread, need)
            fill.append((b, snap, most, True))
            need -= most
            if need == 0:
                return fill
    return []


def _rest(fill: Fill, spread: Iterable[Entry], need: int) -> Fill:
    used = {snap.name for _, snap, _, _ in fill}
    for _, b, _, _ in spread:
        for snap in b.snaps:
            if snap.name in used:
                continue
            fill.append((b, snap, 1, True))
            need -= 1
            if need == 0:
                return fill
    return []


def _candidate(fill: Fill, locality: Locality, member_pods: dict[str, list[_Pod]],
               member_places: dict[str, Place], rack_free: dict[Place, int]) -> _Candidate:
    in_fill = {snap.name for _, snap, _, _ in fill}
    nodes = len(in_fill | member_pods.keys())
    multi = nodes > 1
    upper = math.inf
    for b, snap, c, network in fill:
        if b.members:  # member and new pods share the node's ring ends: weigh them together
            pods = member_pods[snap.name] + list(_pods(b.topo, b.free, b.k, c, network, b.floor))
            upper = min(upper, _pods_value(pods, multi))
        else:
            upper = min(upper, _value(b.topo, b.free, b.k, c, multi, b.floor))
    for name, pods in member_pods.items():
        if name not in in_fill:
            upper = min(upper, _pods_value(pods, multi))
    member_gpus = sum(len(p.gpus) for pods in member_pods.values() for p in pods)
    gpus = sum(c * b.k for b, _, c, _ in fill) + member_gpus
    if gpus <= 1:
        upper = 0.0
    places = {b.place for b, _, _, _ in fill} | set(member_places.values())
    first = next(iter(places))
    split = max(locality.split(a, first) for a in places) if len(places) > 1 else -1
    broken = sum(1 for b, _, c, _ in fill if b.whole and c * b.k < b.topo.size)
    left = sum(b.free_count - c * b.k for b, _, c, _ in fill)
    racks_left = sum(rack_free.get(p, 0) for p in {b.place for b, _, _, _ in fill}) - (gpus - member_gpus)
    return _Candidate(fill, upper, (-upper, split, broken, racks_left, left, nodes))


# -- weighing a fill -------------------------------------------------------------------------------------------


def _exact(request: JobRequest, snaps: dict[str, NodeSnapshot], member_slots: list[PodSlot], remaining: int,
           dropped: tuple[str, ...], locality: Locality, limit: int) -> JobPlan | None:
    """The best plan over every way to put the remaining pods on free GPUs, or None when there are more than
    `limit` ways (the candidate fills take over). Ties go to fewer locality levels crossed, then the best
    pod rings (what the allocator would give each pod), then GPUs nearer a NIC (NCCL enters and leaves a node
    through more than one of a pod's GPUs), then as for candidates: fewer whole free nodes broken,
    fewer GPUs left stranded on the nodes touched, fewer nodes."""
    k = request.gpus_per_pod
    # counted before any is built: on a large cluster the ways are far too many, and listing every node's k-subsets
    # to learn that cost a 32-pod job 30-80 ms at 5,000 nodes
    if math.comb(sum(math.comb(snap.free.bit_count(), k) for snap in snaps.values()), remaining) > limit:
        return None
    options = [(snap, combo) for snap in sorted(snaps.values(), key=lambda n: n.name)
               for combo in combinations(bits(snap.free), k)]
    if request.constrained:
        options = [(snap, combo) for snap, combo in options
                   if _meets(pod_ring_gbps(snap.topo, combo), ring_floor(snap.topo, request))]
    if math.comb(len(options), remaining) > limit:
        return None
    best: tuple[tuple, list[tuple[NodeSnapshot, tuple[int, ...]]]] | None = None
    for chosen in combinations(options, remaining):
        taken: dict[str, int] = {}
        for snap, combo in chosen:
            mask = mask_of(combo)
            if taken.get(snap.name, 0) & mask:
                break
            taken[snap.name] = taken.get(snap.name, 0) | mask
        else:
            pods = [*member_slots, *(PodSlot(snap.name, snap.topo, combo, snap.place) for snap, combo in chosen)]
            estimate = job_allreduce_gbps(pods, locality)
            touched = {snap.name: snap for snap, _ in chosen}
            broken = sum(1 for n in touched.values() if n.free.bit_count() == n.topo.size)
            left = sum(n.free.bit_count() - taken[name].bit_count() for name, n in touched.items())
            rings = sum(pod_ring_gbps(snap.topo, combo) for snap, combo in chosen if len(combo) > 1)
            nics = sum(snap.topo.network_gbps[g] for snap, combo in chosen for g in combo)
            nodes = len(touched.keys() | {p.node for p in member_slots})
            score = (estimate.gbps, estimate.split, -rings, -nics, broken, left, nodes)
            if best is None or _better(score, best[0]):
                best = (score, list(chosen))
    if best is None:
        return None  # no way at all: the candidate search says why
    return _plan_from(request, [(snap.name, snap.topo, combo, snap.place) for snap, combo in best[1]],
                      member_slots, dropped, locality)


def _plan_of(request: JobRequest, fill: Fill, member_slots: list[PodSlot], dropped: tuple[str, ...],
             locality: Locality) -> JobPlan:
    picked = [(snap.name, b.topo, pod.gpus, b.place)
              for b, snap, c, network in fill for pod in _pods(b.topo, b.free, b.k, c, network, b.floor)]
    return _plan_from(request, picked, member_slots, dropped, locality)


def _plan_from(request: JobRequest, picked: list[tuple[str, Topology, tuple[int, ...], Place]],
               member_slots: list[PodSlot], dropped: tuple[str, ...], locality: Locality) -> JobPlan:
    slots = [Slot(name, gpus) for name, _, gpus, _ in picked]
    pods = [*member_slots, *(PodSlot(name, topo, gpus, place) for name, topo, gpus, place in picked)]
    estimate, where, counts = job_figure(pods, locality)
    return JobPlan(request, tuple(slots), estimate, where, dropped, counts)


def _better(a: tuple, b: tuple) -> bool:
    """(gbps, split, broken, racks' free GPUs, stranded, nodes): more bandwidth, then less of everything else."""
    if abs(a[0] - b[0]) > _REL_EPS * max(a[0], b[0], 1e-12):
        return a[0] > b[0]
    return a[1:] < b[1:]
