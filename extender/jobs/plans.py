"""Job plans in the running extender: the first pod of a job plans the whole job and reserves it, later pods take
their slots, and nothing stays reserved once the plan cannot be followed.

Filter of a job's pod (membership read from the pod in the request, its size from annotations or the group objects
the cache watches): a pod whose job cannot be read, or whose GPU count differs from its job's, is refused by every
node with the reason (FailedAndUnresolvable: nothing else can fix it). Otherwise the job's open slots decide: nodes
holding one this pod may take pass, every other node fails with one sentence naming the job and its plan. There is
nothing to take when the job has no plan yet, when a slot was lost (its reservation timed out, its node went away or
changed topology, the node's state shows its GPUs used by someone else), when a member was placed outside the plan,
or when all slots are claimed and the pod is one more: the job is then planned again (extender.jobs.planner) on a
snapshot of every node (free = topology - used - unhealthy - reserved) with the pods already placed as members, and
every new slot is reserved at once under the job, each checked free under its node's lock (the lock bind chooses
under), so no slot and no single pod's plan ever share a GPU. If none of the planned nodes is among the nodes the
scheduler sent (its own filters removed them), the job is planned again on those nodes only. A job whose size is
unknown gets one slot per pod, planned near the members and the other pods' slots. A job that fits nowhere fails
every node with the planner's reason, reserving nothing.

Prioritize: the nodes holding this pod's slots score 10 (9 where fewer of its slots are), the rest 0. Bind
(extender.binder, under the node's lock): a slot of the pod's job on the node becomes the pod's plan, and the job's
reservation of it the pod's own; without one the pod is placed on its own merits, counts as a member placed outside
the plan, and the rest of the job is planned again at its next pod.

Slots end: claimed by a pod; by the reservation timeout like every reservation (nothing is reserved forever); when
the job's last pod leaves the cache (deleted or finished); when their node is deleted; when the job is planned again.
Jobs are kept in a bounded table and forgotten once they hold nothing and the timeout passed.

Locks, always in this order: the planning lock (one job pod's filter at a time), a node's lock, the reservations'
lock; the job table's own lock is a leaf, held only for a few assignments. Bind holds a node's lock and touches only
leaf locks, so it never waits on a planning filter.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import structlog

from extender.jobs import reasons
from extender.jobs.planner import (
    JobPlan,
    JobPlanError,
    JobRequest,
    JobUnplaceable,
    Member,
    NodeSnapshot,
    estimate_text,
    job_figure,
    plan_job,
)
from extender.jobs.reasons import literal, plural
from extender.jobs.spread import Claims, first_pod_nodes
from extender.membership.job import (
    JobRef,
    Membership,
    MembershipError,
    MixedGpuCounts,
    common_gpu_count,
    job_membership,
)
from extender.metrics import ExtenderMetrics
from extender.placement.engine import FilterOutcome
from extender.placement.reasons import Failed, Unresolvable
from extender.state.cache import NodeCache
from extender.state.pods import PodNeeds
from extender.state.reservations import JOB, Reservation
from gputopo.core import Allocation, best_subset
from gputopo.core.bitset import mask_of
from gputopo.core.jobs import Limit, PodSlot

log = structlog.get_logger(__name__)

MAX_JOBS = 10_000
RECENT_PODS = 50_000
_RESERVE_ATTEMPTS = 3
_COMPANION_TEXT = 400  # a CPU-only job pod's whole placement explanation (as extender.placement.explain's)
ROLE = "worker"


@dataclass(frozen=True, slots=True)
class JobPod:
    """A pod of a job as filter and prioritize see it in the request."""

    uid: str
    name: str  # namespace/name
    gpus: int
    membership: Membership | None
    problem: str | None = None  # its job cannot be read: every node refuses it with this
    require_nvlink: bool = False  # its own floors: the plan made at its request meets them (JobRequest)
    min_gbps: float = 0.0
    # A CPU-only pod (gpus=0) whose job nothing holds yet: the GPUs each of the job's GPU pods asks, from its owner
    # object, so that its filter plans the job ahead of them (`_plan_ahead`); None otherwise.
    plan_gpus: int | None = None


@dataclass(frozen=True, slots=True)
class OpenSlot:
    """A reserved slot of a job's plan: `res` is its reservation (gone or replaced: the slot is lost)."""

    holder: str
    node: str
    gpus: tuple[int, ...]
    res: Reservation
    pod_uid: str | None  # jobs of unknown size: the pod it was planned for; else any member may take it


@dataclass(frozen=True, slots=True)
class Claim:
    """A slot a binding pod takes: its GPUs as the allocation bind commits to."""

    key: str
    slot: OpenSlot
    alloc: Allocation


@dataclass
class JobState:
    ref: JobRef
    gpus_per_pod: int
    size: int | None
    plan: JobPlan | None = None
    slots: tuple[OpenSlot, ...] = ()
    members: dict[str, tuple[str, tuple[int, ...]]] = field(default_factory=dict)  # bound by us: uid -> node, GPUs
    touched: float = 0.0
    size_from: str | None = None  # where the size was read (membership), for explanations
    size_note: str | None = None  # why it is unknown
    outside: set[str] = field(default_factory=set)  # members bound by us without a slot of the plan
    unplaceable: str | None = None  # the last reason logged at info: kube-scheduler retries a refused pod often


class JobPlans:
    def __init__(self, cache: NodeCache, metrics: ExtenderMetrics, *, clock: Callable[[], float] | None = None,
                 max_jobs: int = MAX_JOBS) -> None:
        self.cache = cache
        self.reservations = cache.reservations
        self.locality = cache.locality
        self.metrics = metrics
        self.keys = cache.config.keys
        self.clock = clock or cache.reservations.clock
        self.max_jobs = max_jobs
        self._no_place = (None,) * len(self.locality.levels)
        self._states: dict[str, JobState] = {}
        # (why, how many) when sweep forgets idle jobs: what they held ends with no cluster event (extender.requeue)
        self.on_idle: Callable[[str, int], None] = lambda why, n: None
        self._plan_lock = threading.RLock()
        self._state_lock = threading.Lock()
        self._recent: OrderedDict[str, str] = OrderedDict()  # pod uid -> job key, from requests (bind reads it)
        self._serial = itertools.count(1)
        cache.on_node_removed = self.node_gone
        cache.on_job_gone = self.job_gone
        metrics.job_slots.set_function(lambda: float(self.open_slots()))

    # -- reading a pod -----------------------------------------------------------------------------------------

    def pod_of(self, pod: dict[str, Any], needs: PodNeeds) -> JobPod | None:
        """The pod as a member of a job, or None for a pod of no job. A job's pod asking no GPUs (a TFJob's
        parameter server, an MPIJob's launcher) is one with gpus=0 once the job has pods placed or planned, or when
        its job's size and GPUs per pod are known from the owner object (it then plans the job: `_plan_ahead`): it is
        in no plan and every node passes it, but prioritize prefers the rack of the job's GPU pods (`score`)."""
        try:
            membership = job_membership(pod, self.keys, self.cache.groups.sizes, self.cache.owners)
        except MembershipError as e:
            if needs.size == 0:
                return None
            return JobPod(needs.uid, needs.key, needs.size, None, reasons.pod_problem(needs.key, str(e)))
        if membership is None:
            return None
        if needs.size == 0:
            ahead = None
            if self._states.get(membership.job.key) is None:
                ahead = self.cache.owners.gpus_per_pod(pod) if membership.size is not None else None
                if not ahead:
                    return None  # nothing to be near yet, nothing to plan: a pod of its own
            self._remember(needs.uid, membership.job.key)  # bind explains where it went (describe_companion)
            return JobPod(needs.uid, needs.key, 0, membership, plan_gpus=ahead)
        self._remember(needs.uid, membership.job.key)
        return JobPod(needs.uid, needs.key, needs.size, membership, None, needs.need.require_nvlink,
                      needs.need.min_gbps)

    def _remember(self, uid: str, key: str) -> None:
        if uid:
            with self._state_lock:
                self._recent[uid] = key
                self._recent.move_to_end(uid)
                while len(self._recent) > RECENT_PODS:
                    self._recent.popitem(last=False)

    # -- filter and prioritize ---------------------------------------------------------------------------------

    def filter(self, jp: JobPod, names: list[str]) -> FilterOutcome:
        if jp.gpus == 0:  # a CPU-only pod of a job: in no plan, every node passes (prioritize prefers the rack)
            if jp.membership is not None and jp.membership.size is not None:
                self._plan_ahead(jp)
            return FilterOutcome(list(names), {}, {})
        if jp.problem is not None:
            return _refuse_all(names, Unresolvable(jp.problem, limit=reasons.MAX_REASON))
        with self._plan_lock:
            try:
                state = self._state_for(jp)
            except MembershipError as e:
                return _refuse_all(names, Unresolvable(reasons.pod_problem(jp.name, str(e)), limit=reasons.MAX_REASON))
            except JobUnplaceable as e:
                return _refuse_all(names, Failed(e.reason, limit=reasons.MAX_REASON))
            usable = self._usable(state, jp.uid)
            if usable and not set(names).intersection(s.node for s in usable):
                usable = []  # the scheduler's own filters removed every planned node: plan on what it sent
                restrict: list[str] | None = names
            else:
                restrict = None
            if not usable:
                try:
                    self._plan(state, jp, restrict)
                    usable = self._usable(state, jp.uid) or []
                    if restrict is None and not set(names).intersection(s.node for s in usable):
                        self._plan(state, jp, names)
                        usable = self._usable(state, jp.uid) or []
                except JobUnplaceable as e:
                    self.metrics.job_plans.labels("unplaceable").inc()
                    said, state.unplaceable = state.unplaceable, e.reason
                    (log.debug if said == e.reason else log.info)(
                        "extender.job.unplaceable", job=str(state.ref), pod=jp.name, reason=e.reason)
                    return _refuse_all(names, Failed(e.reason, limit=reasons.MAX_REASON))
                except JobPlanError as e:
                    self.metrics.job_plans.labels("bad_job").inc()
                    return _refuse_all(names, Unresolvable(str(e), limit=reasons.MAX_REASON))
            return self._answer(state, usable, names)

    def _plan_ahead(self, jp: JobPod) -> None:
        """A CPU-only pod of a job of known size while the job holds nothing (no open slot, no pod placed): a
        TFJob's parameter servers, which the training operator often creates before the workers (it walks the
        replica types in Go map order). The job's GPU pods are planned and reserved now, on every node, as their
        first pod would plan them, so that this pod is scored next to where they will go (`_near_scores`), not at
        chance; the GPU pods then take the slots. Never refuses this pod: a job that cannot be planned now is
        planned at its first GPU pod, and this pod is scored as a pod of its own."""
        m = jp.membership
        assert m is not None
        with self._plan_lock:
            state = self._states.get(m.job.key)
            k = state.gpus_per_pod if state is not None else jp.plan_gpus
            if not k or (state is not None and (any(map(self._open, state.slots)) or self._members(state))):
                return
            gpu_pod = JobPod("", jp.name, k, m)
            try:
                state = self._state_for(gpu_pod)
                self._plan(state, gpu_pod, None)
            except (MembershipError, JobUnplaceable, JobPlanError) as e:
                reason = e.reason if isinstance(e, JobUnplaceable) else str(e)
                log.info("extender.job.plan_ahead_failed", job=str(m.job), pod=jp.name,
                         reason=reasons.bounded(reason))
                return
        log.info("extender.job.planned_ahead", job=str(m.job), pod=jp.name, role=m.role, gpus_per_pod=k,
                 size=state.size)

    def score(self, jp: JobPod, names: list[str]) -> list[int] | None:
        """10 for the nodes holding the most of this pod's open slots, 9 for others holding one, 0 elsewhere; None
        when the pod has no slot (prioritize then scores it as a pod of its own)."""
        if jp.membership is None:
            return [0] * len(names)
        state = self._states.get(jp.membership.job.key)
        if state is None:
            return None
        if jp.gpus == 0:
            return self._near_scores(state, jp, names)
        counts = Counter(s.node for s in state.slots if s.pod_uid in (None, jp.uid) and self._open(s))
        if not counts:
            return None
        top = max(counts.values())
        return [0 if not (c := counts.get(n, 0)) else 10 if c == top else 9 for n in names]

    def _near_scores(self, state: JobState, jp: JobPod, names: list[str]) -> list[int] | None:
        """A CPU-only pod of a job (a TFJob's parameter server) next to the job's GPU pods: 10 in the rack holding
        most of them (placed, or planned in open slots), 8 in another rack holding some, 5 sharing an outer level
        (spine, zone) with one, 0 elsewhere; None (scored as a pod of its own) while the job holds nothing."""
        held = [m.node for m in self._members(state).values()] + [s.node for s in state.slots if self._open(s)]
        places = [e.place for n in held if (e := self.cache.nodes.get(n)) is not None and e.place]
        if not places:
            return None
        racks = Counter(p[0] for p in places if p[0] is not None)
        top = racks.most_common(1)[0][0] if racks else None

        def score(name: str) -> int:
            entry = self.cache.nodes.get(name)
            place = entry.place if entry is not None else None
            if not place:
                return 0
            if place[0] is not None and place[0] == top:
                return 10
            if place[0] is not None and place[0] in racks:
                return 8
            return 5 if any(v is not None and any(v == p[i] for p in places) for i, v in enumerate(place)
                            if i > 0) else 0

        scores = [score(n) for n in names]
        log.info("extender.job.companion", job=str(state.ref), pod=jp.name, rack=top, gpu_pods=len(held))
        return scores

    def describe_companion(self, uid: str, node: str) -> str | None:
        """The placement explanation (`<prefix>/placement`) of a job's pod asking no GPU (a TFJob's parameter
        server) bound to `node`: the job, and where the pod sits against the job's GPU pods placed or planned (the
        rack `_near_scores` preferred); None for a pod of no job followed here. Written by bind (extender.binder)
        for a pod without a plan."""
        key = self._job_of(uid)
        state = self._states.get(key) if key is not None else None
        if state is None:
            return None
        held = Counter(m.node for m in self._members(state).values())
        held.update(s.node for s in state.slots if self._open(s))
        level = self.locality.levels[0].name
        entry = self.cache.nodes.get(node)
        rack = entry.place[0] if entry is not None and entry.place else None
        known = f"{state.size} {ROLE}s" if state.size is not None else "size unknown"
        head = f"job {state.ref} ({known}): asks no GPU, placed on {node}"
        if not held:
            return reasons.bounded(f"{head} on its own merits: the job holds no GPUs yet", _COMPANION_TEXT)
        racks: Counter[str | None] = Counter()
        for n, c in held.items():
            e = self.cache.nodes.get(n)
            racks[e.place[0] if e is not None and e.place else None] += c
        total = sum(held.values())
        if rack is not None and racks.get(rack):
            where = f"in {level} {rack} with {racks[rack]} of the job's {total} GPU pods placed or planned"
        elif node in held:
            where = f"beside {held[node]} of the job's {total} GPU pods placed or planned"
        else:
            where = (f"in {level} {rack if rack is not None else '(none)'}, away from the job's {total} GPU pods "
                     "placed or planned (no node of theirs was feasible or scored higher)")
        return reasons.bounded(f"{head} {where} ({reasons.nodes_shown(dict(held))})", _COMPANION_TEXT)

    # -- bind (extender.binder, under the node's lock) ---------------------------------------------------------

    def slot_for(self, uid: str, node: str, gpus: int) -> Claim | None:
        """An open slot of the pod's job on `node` that the pod may take, or None."""
        key = self._job_of(uid)
        state = self._states.get(key) if key is not None else None
        entry = self.cache.nodes.get(node)
        if state is None or state.gpus_per_pod != gpus or entry is None or entry.topo is None:
            return None
        for s in state.slots:
            if s.node == node and s.pod_uid in (None, uid) and self._open(s):
                return Claim(state.ref.key, s, best_subset(entry.topo, s.gpus, gpus))
        return None

    def bound(self, uid: str, node: str, gpus: tuple[int, ...], claim: Claim | None) -> None:
        """The pod now holds `gpus` on `node` (its own reservation, or committed): the slot it took ends; a job pod
        placed without a slot leaves its job's plan behind, so the rest is planned again at the next pod."""
        key = claim.key if claim is not None else self._job_of(uid)
        if key is None:
            return
        ended: list[OpenSlot] = []
        with self._state_lock:
            state = self._states.get(key)
            if state is None:
                return
            state.members[uid] = (node, tuple(gpus))
            state.touched = self.clock()
            if claim is None:
                state.outside.add(uid)
            else:
                state.outside.discard(uid)
            if claim is not None:
                state.slots = tuple(s for s in state.slots if s is not claim.slot)
                ended.append(claim.slot)
            elif state.size is not None and state.slots:
                ended, state.slots, state.plan = list(state.slots), (), None
        if claim is not None:
            self._end([claim.slot], "claimed")
        elif ended:
            log.info("extender.job.left_plan", job=str(state.ref), pod_uid=uid, node=node,
                     released=len(ended))
            self._end(ended, "replanned")

    # -- the cache's events ------------------------------------------------------------------------------------

    def job_gone(self, key: str) -> None:
        """The job's last pod left the cache: its slots end."""
        with self._state_lock:
            state = self._states.pop(key, None)
        if state is not None and state.slots:
            log.info("extender.job.gone", job=str(state.ref), released=len(state.slots))
            self._end(list(state.slots), "job_gone")

    def node_gone(self, name: str) -> None:
        """A node was deleted: the slots on it end, and a job of known size is planned again at its next pod."""
        ended: list[OpenSlot] = []
        with self._state_lock:
            for state in self._states.values():
                if not any(s.node == name for s in state.slots):
                    continue
                if state.size is not None:
                    ended.extend(state.slots)
                    state.slots, state.plan = (), None
                else:
                    ended.extend(s for s in state.slots if s.node == name)
                    state.slots = tuple(s for s in state.slots if s.node != name)
        if ended:
            log.info("extender.job.node_gone", node=name, released=len(ended))
            self._end(ended, "node_gone")

    def sweep(self) -> None:
        """Forget jobs holding nothing (no open slot, no pod still placed by us) untouched for the reservation
        timeout; their pods, should they come back, plan afresh."""
        cutoff = self.clock() - self.reservations.timeout_s
        with self._state_lock:
            idle = [k for k, s in self._states.items() if s.touched <= cutoff and not any(map(self._open, s.slots))]
            for key in idle:
                del self._states[key]
        if idle:
            self.on_idle("job_idle", len(idle))  # a job of unknown size no longer holds room for its next pods

    def describe(self, uid: str) -> str | None:
        """The job's part of a bound pod's placement explanation (`<prefix>/placement`); None for a pod of no job.

        What it states, and when. It is written once, with the Binding, so it says the job as known at this pod's
        bind, labelled so: how the job's size is known (or why it is not), how many of its pods are placed with
        this one, and the job's figure (nodes, estimated all-reduce, what limits it). For a job of known size that
        figure is its plan's, which covers every pod ("2 of 4 placed with this pod; planned at this bind: the job on
        rack r0 (n1 x2, n2 x2), est. 12.5 GB/s all-reduce, ..."); for a job
        of unknown size, planned a pod at a time, there is no plan of the whole, so the figure is that of the pods
        placed so far, this one included ("job so far, with this pod: 3 of ? workers on node n0 (n0 x3), ...;
        later pods may change it"). A pod placed outside its job's plan says so, with the job so far.

        Why not keep every pod's figure up to date: it would mean patching each earlier pod of the job whenever
        the figure changes. A job of unknown size changes it at nearly every pod, so n pods cost up to n(n-1)/2
        pod PATCHes (an 8,192-pod job: 33 million), written by the process that also posts the Bindings, each
        a write the apiserver and every pod watcher (this extender's own cache, kubelets, operators) must take;
        and for a job of unknown size no figure is ever final. A reader of `kubectl describe pod` needs to know
        what the figure is the figure of: labelled, each pod's stays true, and the job's newest pod carries its
        latest figure (the log event extender.job.planned says each plan)."""
        key = self._job_of(uid)
        state = self._states.get(key) if key is not None else None
        if state is None:
            return None
        ref, plan = state.ref, state.plan
        if state.size is not None:
            known = (f"{plural(state.size, ROLE)}, from {state.size_from}" if state.size_from
                     else plural(state.size, ROLE))
        else:
            known = f"size unknown, {state.size_note or 'nothing says it'}; placed a pod at a time"
        members = self._members(state)
        placed = len(members)
        if uid in state.outside or plan is None or state.size is None:
            so_far, fields = self._so_far(state, members)
            if uid in state.outside:
                head = "placed outside the job's plan (no slot of it on this node), the rest planned again; "
            else:
                head = ""
            if not so_far:
                return reasons.job_explained(str(ref), known, literal(head.rstrip("; ")) or "nothing placed")
            tail = "; later pods may change it" if state.size is None or placed < state.size else ""
            return reasons.job_explained(str(ref), known, f"{literal(head)}job so far, with this pod: {so_far}{tail}",
                                         **fields)
        return reasons.job_explained(
            str(ref), known, f"{placed} of {state.size} placed with this pod; planned at this bind: the job on "
                             f"{{where}} ({{nodes}}), {literal(estimate_text(plan.estimate))}",
            where=plan.where, nodes=reasons.nodes_shown(plan.counts))

    def _so_far(self, state: JobState, members: dict[str, Member]) -> tuple[str, dict[str, object]]:
        """The words of the job's pods placed now (reasons.figure), or '' when none can be weighed."""
        pods = []
        for m in members.values():
            entry = self.cache.nodes.get(m.node)
            if entry is not None and entry.topo is not None and all(0 <= g < entry.topo.size for g in m.gpus):
                pods.append(PodSlot(m.node, entry.topo, m.gpus, entry.place or self._no_place))
        if not pods:
            return "", {}
        estimate, where, counts = job_figure(pods, self.locality)
        total = str(state.size) if state.size is not None else "?"
        return reasons.figure(len(pods), total, ROLE, where, counts, estimate_text(estimate))

    def open_slots(self) -> int:
        return sum(len(s.slots) for s in list(self._states.values()))

    def state(self, key: str) -> JobState | None:
        """The job's state (for the inventory view and tests)."""
        return self._states.get(key)

    # -- internals -------------------------------------------------------------------------------------------

    def _job_of(self, uid: str) -> str | None:
        rec = self.cache.pods.get(uid)
        if rec is not None and rec.membership is not None:
            return rec.job_key
        return self._recent.get(uid)

    def _open(self, slot: OpenSlot) -> bool:
        return self.reservations.get(slot.holder, slot.node) is slot.res

    def _state_for(self, jp: JobPod) -> JobState:
        """The job's state, created on its first pod; raises MixedGpuCounts when pods of the job ask different GPU
        counts (those the cache holds, this one, the plan's)."""
        m = jp.membership
        assert m is not None
        known = [(rec.key, rec.needs.size) for uid in self.cache.jobs.uids(m.job.key)
                 if (rec := self.cache.pods.get(uid)) is not None and rec.needs is not None and uid != jp.uid]
        k = common_gpu_count(m.job, [(jp.name, jp.gpus), *known])
        assert k is not None
        now = self.clock()
        stale: list[OpenSlot] = []
        with self._state_lock:
            state = self._states.get(m.job.key)
            if state is None:
                if len(self._states) >= self.max_jobs:
                    raise JobUnplaceable(f"job {m.job}: the extender already follows {self.max_jobs} jobs; "
                                         "retried once some end")
                state = self._states[m.job.key] = JobState(m.job, k, m.size, touched=now)
            if state.gpus_per_pod != k:
                if state.slots or state.members:
                    raise MixedGpuCounts(reasons.job_says(
                        str(m.job), f"pod {{pod}} asks {plural(jp.gpus, 'GPU')}, the job's plan is for pods of "
                                    f"{state.gpus_per_pod}; a job plan gives each member the same number of GPUs",
                        pod=jp.name))
                state.gpus_per_pod = k
            state.size_from, state.size_note = m.size_from, m.size_note
            if m.size is not None and m.size != state.size:  # known now (its PodGroup arrived), or changed
                stale, state.slots, state.plan, state.size = list(state.slots), (), None, m.size
            state.touched = now
        self._end(stale, "replanned")
        return state

    def _members(self, state: JobState) -> dict[str, Member]:
        """Pods of the job placed now: bound ones the cache shows with their plans, and those bound by us that it
        does not show yet (their reservation stands). Pods whose GPU count is not the job's are left out."""
        out: dict[str, Member] = {}
        k = state.gpus_per_pod
        for uid in self.cache.jobs.uids(state.ref.key):
            rec = self.cache.pods.get(uid)
            if rec is None or rec.node is None or rec.plan is None or rec.plan.node != rec.node:
                continue
            entry = self.cache.nodes.get(rec.node)
            if entry is None or entry.topo is None:
                continue
            idx = [entry.index.get(i) for i in rec.plan.ids]
            if len(idx) == k and None not in idx:
                out[uid] = Member(rec.node, tuple(sorted(idx)))  # type: ignore[arg-type]
        with self._state_lock:
            ours = list(state.members.items())
        for uid, (node, gpus) in ours:
            if uid in out:
                continue
            rec = self.cache.pods.get(uid)
            if self.reservations.get(uid, node) is not None or (rec is not None and rec.node == node):
                if len(gpus) == k:
                    out[uid] = Member(node, gpus)
            else:  # its bind failed, or it ended
                with self._state_lock:
                    state.members.pop(uid, None)
                    state.outside.discard(uid)
        return out

    def _usable(self, state: JobState, uid: str) -> list[OpenSlot] | None:
        """The open slots this pod may take; None when the plan can no longer be followed (a slot was lost, or a
        member was placed outside it) and must be made again."""
        slots = state.slots
        live = [s for s in slots if self._open(s)]
        if len(live) < len(slots):
            if state.size is not None:
                return None
            lost = [s for s in slots if s not in live]
            with self._state_lock:
                state.slots = tuple(s for s in state.slots if s not in lost)
            self._end(lost, "replanned")
        if state.size is not None and live and len(self._members(state)) + len(live) > state.size:
            return None
        return [s for s in live if s.pod_uid in (None, uid)]

    def _plan(self, state: JobState, jp: JobPod, names: list[str] | None) -> JobPlan:
        """Plan the job's remaining pods (all of them for a known size, this pod's alone otherwise) and reserve
        every slot. Raises JobUnplaceable, JobPlanError."""
        for _ in range(_RESERVE_ATTEMPTS):
            self._drop(state, None if state.size is not None else jp.uid)
            members = self._members(state)
            size = state.size
            if size is not None and len(members) >= size:
                size = None  # one pod more than the job's size (a replacement): placed near the others
            placed = list(members.values())
            if size is None:  # the other pods' slots count as placed: this one goes near them too
                placed += [Member(s.node, s.gpus) for s in state.slots]
            request = JobRequest(str(state.ref), state.gpus_per_pod, size, tuple(placed), ROLE, jp.require_nvlink,
                                 jp.min_gbps)
            started = time.perf_counter()
            snaps = self._snapshot(state.gpus_per_pod, names, {m.node for m in placed})
            if size is None and not placed:  # a first pod of unknown size: not where other such jobs grow
                claims = self._open_ended_claims(state)
                snaps = first_pod_nodes(snaps, claims, state.gpus_per_pod)
                if not snaps:
                    note = jp.membership.size_note if jp.membership is not None else None
                    raise JobUnplaceable(reasons.first_pod_waits(str(state.ref), note, state.gpus_per_pod,
                                                                 claims.count, self.keys.job_size))
            plan = plan_job(request, snaps, self.locality)
            self.metrics.job_plan_seconds.observe(time.perf_counter() - started)
            if self._reserve(state, plan, None if size is not None else jp.uid):
                self.metrics.job_plans.labels("planned").inc()
                log.info("extender.job.planned", job=str(state.ref), pod=jp.name,
                         summary=reasons.bounded(plan.summary), slots=len(plan.slots),
                         nodes=len({s.node for s in plan.slots}), among=len(names) if names else "all",
                         ms=round((time.perf_counter() - started) * 1000, 2))
                return plan
        raise JobUnplaceable(f"job {state.ref}: the GPUs planned for it were taken while they were being reserved, "
                             f"{_RESERVE_ATTEMPTS} times in a row; it is planned again at its next attempt")

    def _open_ended_claims(self, state: JobState) -> Claims:
        """What other jobs of unknown size placed or planned within the reservation timeout hold, per node."""
        cutoff = self.clock() - self.reservations.timeout_s
        with self._state_lock:
            others = [s for s in self._states.values()
                      if s is not state and s.size is None and s.touched > cutoff]
            held = [[*((n, len(g)) for n, g in s.members.values()), *((x.node, len(x.gpus)) for x in s.slots)]
                    for s in others]
        return Claims.of(held)

    def _snapshot(self, k: int, names: list[str] | None, member_nodes: set[str]) -> list[NodeSnapshot]:
        nodes = self.cache.nodes
        masks = self.reservations.masks
        if names is None:
            entries: Iterable[Any] = list(nodes.values())
        else:
            entries = [nodes.get(n) for n in dict.fromkeys([*names, *member_nodes])]
        out = []
        for e in entries:
            if e is None or e.topo is None:
                continue
            free = 0 if e.unschedulable else e.base_free & ~masks.get(e.name, 0)
            if free.bit_count() < k and e.name not in member_nodes:
                continue
            out.append(NodeSnapshot(e.name, e.topo, free, e.place or self._no_place))
        return out

    def _reserve(self, state: JobState, plan: JobPlan, pod_uid: str | None) -> bool:
        """Reserve every slot, each checked free under its node's lock; on a GPU taken meanwhile, undo and say so."""
        made: list[OpenSlot] = []
        ref = state.ref
        for slot in plan.slots:
            mask = mask_of(slot.gpus)
            with self.cache.lock_for(slot.node):
                entry = self.cache.nodes.get(slot.node)
                if entry is None or entry.topo is None or self.cache.free_mask(entry) & mask != mask:
                    log.info("extender.job.reserve_raced", job=str(ref), node=slot.node)
                    self._end(made, "replanned")
                    return False
                holder = f"job:{ref.key}#{next(self._serial)}"
                res = self.reservations.add(holder, ref.namespace, f"{ref.name} (job slot)", slot.node,
                                            [entry.topo.gpus[i].id for i in slot.gpus], mask, JOB)
            made.append(OpenSlot(holder, slot.node, slot.gpus, res, pod_uid))
        with self._state_lock:
            state.slots = (*state.slots, *made)
            state.plan = plan
            state.touched = self.clock()
        return True

    def _drop(self, state: JobState, pod_uid: str | None) -> None:
        """End the job's open slots before planning again (a job of unknown size: only this pod's)."""
        with self._state_lock:
            if pod_uid is None:
                gone, state.slots, state.plan = list(state.slots), (), None
            else:
                gone = [s for s in state.slots if s.pod_uid == pod_uid]
                state.slots = tuple(s for s in state.slots if s.pod_uid != pod_uid)
        self._end(gone, "replanned")

    def _end(self, slots: Iterable[OpenSlot], why: str) -> None:
        ended = sum(1 for s in slots if self.reservations.release_if(s.holder, s.node, s.res))
        if ended:
            self.cache.on_reservation_end(why, ended)

    def _answer(self, state: JobState, usable: list[OpenSlot], names: list[str]) -> FilterOutcome:
        counts = Counter(s.node for s in usable)
        passed = [n for n in names if n in counts]
        if len(passed) == len(names):
            return FilterOutcome(passed, {}, {})
        plan = state.plan
        placed = len(self._members(state))
        where = plan.where if plan is not None else "the cluster"
        gbps = plan.estimate.gbps if plan is not None and plan.estimate.limit is not Limit.NONE else None
        reason = Failed(reasons.not_in_plan(str(state.ref), placed, state.size, ROLE, len(usable), where,
                                            sorted(counts), gbps), limit=reasons.MAX_REASON)
        return FilterOutcome(passed, {n: reason for n in names if n not in counts}, {})


def _refuse_all(names: list[str], reason: Failed | Unresolvable) -> FilterOutcome:
    if isinstance(reason, Unresolvable):
        return FilterOutcome([], {}, dict.fromkeys(names, reason))
    return FilterOutcome([], dict.fromkeys(names, reason), {})
