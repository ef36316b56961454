"""The extender's view of the cluster: every node's topology, GPU state and locality, the GPU pods and the jobs
they belong to, the group sizes of those jobs, and the reservations.

Fed by watches on Nodes and Pods (extender.state.cluster) or by an inventory file (extender.state.inventory).
Readers on the filter hot path take no lock: entries are immutable and replaced whole, and reservation masks are a
plain dict. Writers that must be atomic with a placement decision (bind's choose+reserve, a node state update that
settles reservations) hold the node's lock, so a GPU never looks free in the gap between two updates.

Garbage written into our annotations by someone else never breaks the cache: the node then counts as publishing no
topology (or the pod as having no plan), and the reason is logged once per distinct value.

A pod that is gone (deleted, or terminal) stops holding GPUs at once, whatever still shows them (issue: preemption
evicted twice the victims needed, kube-scheduler retrying its preemptor before the extender saw the victims go):
- its reservation ends (remove_pod);
- the GPUs of its plan that its node's published state still shows used count free (`_freed`) until the state
  stops showing them, or FREED_TIMEOUT_S passes: the kubelet lets go of a pod's devices once the pod is terminal or
  deleted, and the plugin republishes a moment later (gpuplugin.publisher), so until then the state is stale. A
  plan made meanwhile on those GPUs is reserved, and its reservation does not settle against the stale state;
- a pod removed from the cache is remembered as gone (`_gone`), so a late watch event of it cannot bring it back;
- `confirm_node_pods` takes the apiserver's current pods of a node (a consistent list) and drops every pod the
  cache still places there that is gone: kube-scheduler's informer and the extender's watch see a deletion at
  about the same moment, and kube-scheduler retries a preemptor within milliseconds of it (extender.verbs asks).
A pod with a deletionTimestamp that is not yet terminal still runs: it keeps its GPUs until the kubelet ends it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import structlog

from extender.config import ExtenderConfig
from extender.membership.groups import GroupSizes
from extender.membership.index import JobIndex
from extender.membership.job import Membership, MembershipError, job_membership
from extender.membership.ownership import OwnerShapes
from extender.state.mig import NodeMig, node_mig
from extender.state.pods import PodNeeds, PodNeedsCache, PodSpecError, parse_quantity
from extender.state.reservations import JOB, POD, Reservation, Reservations
from extender.state.sharing import NodeSharing, fell, node_sharing, thresholds
from gputopo.contract import (
    REMOVAL_TAINTS,
    SOFT_REMOVAL_TAINTS,
    Plan,
    PlanFormatError,
    is_mig_resource,
    parse_plan,
)
from gputopo.core import Topology, TopologyError, state_from_json, topology_from_json
from gputopo.core.bitset import mask_of
from gputopo.core.locality import Place

log = structlog.get_logger(__name__)

_TOPOLOGY_CACHE_LIMIT = 4096
_INTERN_LIMIT = 200_000
TERMINAL_PHASES = frozenset({"Succeeded", "Failed"})
UNUSABLE = "!"  # first element of the state of a node that offers nothing to plan on
CORDONED = "node is cordoned (spec.unschedulable)"
# How long the GPUs of a gone pod count free while its node's state still shows them used: the kubelet lets go at
# once and the plugin republishes within about a second; a GPU still published used long after is someone else's.
FREED_TIMEOUT_S = 60.0
GONE_LIMIT = 50_000  # uids of pods seen gone, remembered so that late events of them are ignored


def _dict(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True, slots=True)
class NodeEntry:
    """One node as placement sees it. `problem` set means the node offers nothing to plan on (unresolvable)."""

    name: str
    topo: Topology | None
    problem: str | None
    index: Mapping[str, int]
    used_ids: frozenset[str]
    unhealthy_ids: frozenset[str]
    used_mask: int
    unhealthy_mask: int
    base_free: int  # topology - used - unhealthy (reservations are applied by the reader)
    total: int  # GPUs the node can ever offer: topology size, or allocatable when lower
    unschedulable: bool
    generation: int
    fingerprint: str
    place: Place = ()  # where it sits in the network (--locality levels from its labels)
    sharing: NodeSharing | None = None  # GPUs shared as replicas (extender.state.sharing); never offered whole
    mig: NodeMig | None = None  # MIG GPUs and their instances (extender.state.mig); never offered whole
    # an autoscaler's taint on the node (autoscaler_taint): a removal one makes it unschedulable too; the soft
    # one ranks it last among equally good nodes, so it can empty
    removal: str = ""

    def serves_mig(self, resource: str) -> bool:
        return self.mig is not None and self.mig.serves(resource)

    def shares(self, resource: str) -> bool:
        return self.sharing is not None and self.sharing.resource(resource) is not None


@dataclass(frozen=True, slots=True)
class PodRecord:
    uid: str
    namespace: str
    name: str
    node: str | None
    phase: str
    deleting: bool
    needs: PodNeeds | None
    plan: Plan | None
    plan_text: str | None
    priority: int | None = None  # spec.priority (preemption compares victims by it)
    membership: Membership | None = None  # its job (extender.membership.job), sizes left to the filter
    membership_error: str | None = None  # why its job cannot be read

    @property
    def terminal(self) -> bool:
        return self.phase in TERMINAL_PHASES

    @property
    def job_key(self) -> str | None:
        return self.membership.job.key if self.membership is not None else None

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


class PlacementState:
    """Everything filter and prioritize depend on for one node. Interned by NodeCache (equal states are one
    object), so the verbs memoise on it with identity hashing: a pointer hash instead of a tuple's per lookup."""

    __slots__ = ("draining", "fingerprint", "free", "key", "problem", "reserved", "total", "unhealthy", "used")

    def __init__(self, key: tuple[Any, ...]) -> None:
        self.key = key
        if key[0] == UNUSABLE:
            self.problem: str | None = key[1]
            self.fingerprint, self.free, self.total, self.used, self.unhealthy, self.reserved = "", 0, 0, 0, 0, 0
            self.draining = False
        else:
            self.problem = None
            (self.fingerprint, self.free, self.total, self.used, self.unhealthy, self.reserved,
             self.draining) = key


def state_key(entry: NodeEntry, reserved: int) -> tuple[Any, ...]:
    """(fingerprint, free, total, used, unhealthy, reserved, draining) for a usable node, (UNUSABLE, why)
    otherwise; draining: an autoscaler marked it as a removal candidate."""
    if entry.topo is None:
        return (UNUSABLE, entry.problem or "publishes no GPU topology")
    if entry.unschedulable:
        return (UNUSABLE, being_removed(entry.removal) if entry.removal in REMOVAL_TAINTS else CORDONED)
    reserved &= entry.base_free
    return (entry.fingerprint, entry.base_free & ~reserved, entry.total, entry.used_mask, entry.unhealthy_mask,
            reserved, entry.removal in SOFT_REMOVAL_TAINTS)


def being_removed(taint: str) -> str:
    return f"node is being removed by an autoscaler (taint {taint})"


def autoscaler_taint(spec: Mapping[str, Any]) -> str:
    """The key of the autoscaler taint on a Node's spec that matters most: one that removes the node
    (CA's ToBeDeletedByClusterAutoscaler, Karpenter's karpenter.sh/disrupted) over CA's soft deletion-candidate
    taint; "" for none. Read from the Node, never from a pod's tolerations: a pod tolerating every taint would
    otherwise be placed on a node about to go."""
    found = ""
    taints = spec.get("taints")
    for t in taints if isinstance(taints, list) else ():
        key = t.get("key") if isinstance(t, dict) else None
        if key in REMOVAL_TAINTS:
            return str(key)
        if key in SOFT_REMOVAL_TAINTS:
            found = str(key)
    return found


def make_entry(
    name: str,
    topo: Topology | None,
    *,
    problem: str | None = None,
    index: Mapping[str, int] | None = None,
    used: Iterable[str] = (),
    unhealthy: Iterable[str] = (),
    allocatable: int | None = None,
    unschedulable: bool = False,
    generation: int = 0,
    place: Place = (),
    sharing: NodeSharing | None = None,
    mig: NodeMig | None = None,
    removal: str = "",
) -> NodeEntry:
    """Build an entry; ids the topology does not know are dropped (logged by the caller). Shared GPUs are neither
    free nor counted in the total for whole-GPU pods: they are offered only as replicas."""
    used_ids, unhealthy_ids = frozenset(used), frozenset(unhealthy)
    if topo is None:
        return NodeEntry(name, None, problem or "publishes no GPU topology", {}, used_ids, unhealthy_ids, 0, 0, 0, 0,
                         unschedulable, generation, "", place, None, mig, removal)
    idx = index if index is not None else {g.id: g.index for g in topo.gpus}
    used_mask = mask_of(idx[i] for i in used_ids if i in idx)
    bad_mask = mask_of(idx[i] for i in unhealthy_ids if i in idx)
    shared = sharing.mask if sharing is not None else 0
    full = ((1 << topo.size) - 1) & ~shared
    whole = topo.size - shared.bit_count()
    total = whole if allocatable is None else min(whole, allocatable)
    return NodeEntry(name, topo, problem, idx, used_ids, unhealthy_ids, used_mask, bad_mask,
                     full & ~used_mask & ~bad_mask, total, unschedulable, generation, topo.fingerprint, place,
                     sharing, mig, removal)


def without_used(entry: NodeEntry, ids: Iterable[str]) -> NodeEntry:
    """The entry with the whole GPUs `ids` no longer counted used (the GPUs of pods that are gone, which the node's
    published state still shows used); ids it does not show used, or shared GPUs, are left as they are."""
    drop = entry.used_ids & frozenset(ids)
    if not drop or entry.topo is None:
        return entry
    shared = entry.sharing.mask if entry.sharing is not None else 0
    mask = mask_of(entry.index[i] for i in drop if i in entry.index) & ~shared
    return replace(entry, used_ids=entry.used_ids - drop, used_mask=entry.used_mask & ~mask,
                   base_free=entry.base_free | (mask & ~entry.unhealthy_mask))


def _uid_of(obj: Any) -> str | None:
    uid = _dict(_dict(obj).get("metadata")).get("uid")
    return uid if isinstance(uid, str) and uid else None


class NodeCache:
    """Nodes, GPU pods and reservations, kept consistent with each other."""

    def __init__(self, config: ExtenderConfig, reservations: Reservations) -> None:
        self.config = config
        self.locality = config.network_locality()
        self.reservations = reservations
        self.groups = GroupSizes()  # job sizes from PodGroups and Workloads (fed by extender.state.cluster)
        self.owners = OwnerShapes(config.resource_name, config.job_owner_kinds)  # job sizes from their owners
        self.jobs = JobIndex()
        # each pod's needs, read once by UID for the pod watch and every verb (extender.state.pods.PodNeedsCache)
        self.needs = PodNeedsCache(config.resource_name, config.keys)
        self.nodes: dict[str, NodeEntry] = {}
        self.states: dict[str, PlacementState] = {}  # node -> its state, kept current for the hot path
        self._interned: dict[tuple[Any, ...], PlacementState] = {}
        self.topologies: dict[str, Topology] = {}  # fingerprint -> a topology with it
        self._state_lock = threading.Lock()
        self.pods: dict[str, PodRecord] = {}
        self._node_locks: dict[str, threading.RLock] = {}
        self._locks_guard = threading.Lock()
        self._pods_lock = threading.RLock()
        self._parsed_topologies: dict[str, tuple[Topology | None, Mapping[str, int], str | None]] = {}
        self._topo_lock = threading.Lock()
        self._settled: dict[str, str] = {}  # pod uid -> node whose reservation ended (never rebuild it)
        self._published: dict[str, NodeEntry] = {}  # node -> its entry as its annotations say (before `_freed`)
        self._freed: dict[str, dict[str, float]] = {}  # node -> GPU id of a gone pod, shown used -> until when
        self._gone: OrderedDict[str, None] = OrderedDict()  # uids of pods seen gone (module docstring)
        self._reported: dict[str, str] = {}  # node or pod -> last problem logged
        # metrics hook: (why, how many) each time reservations end: settled, pod_gone, timeout, topology_changed
        self.on_reservation_end: Callable[[str, int], None] = lambda why, n: None
        # job plans' hooks (extender.jobs.plans): a node left the cache; a job's last pod left it
        self.on_node_removed: Callable[[str], None] = lambda name: None
        self.on_job_gone: Callable[[str], None] = lambda key: None
        # a node became usable here (its GPUs published): kube-scheduler may have retried a pod on the same Node
        # event before this cache saw the GPUs, and been refused (extender.requeue)
        self.on_node_usable: Callable[[str], None] = lambda name: None
        # called with a node's name after its state (self.states) changed or went: answers kept per node name
        # (extender.placement.engine) are forgotten there, so they change exactly when the node's inputs do
        self.on_state_change: list[Callable[[str], None]] = []
        self.shared_names: frozenset[str] = frozenset()  # resource names some node shares (replicas)
        self._shared_by: dict[str, frozenset[str]] = {}  # node -> the names it shares
        self.mig_names: frozenset[str] = frozenset()  # resource names some node's MIG instances are advertised as
        self._mig_by: dict[str, frozenset[str]] = {}
        self._changed = threading.Condition()
        self.version = 0  # bumped on every change, so waiters (readiness, tests, demos) need no polling
        reservations.on_change = self._refresh_state
        self.groups.on_change = self._bump
        self.owners.on_change = self._bump

    # -- locks and reads -------------------------------------------------------------------------------------

    def lock_for(self, node: str) -> threading.RLock:
        """The node's lock (re-entrant: a standalone bind installs the new entry while holding it)."""
        lock = self._node_locks.get(node)
        if lock is None:
            with self._locks_guard:
                lock = self._node_locks.setdefault(node, threading.RLock())
        return lock

    def free_mask(self, entry: NodeEntry) -> int:
        return entry.base_free & ~self.reservations.masks.get(entry.name, 0)

    def _refresh_state(self, name: str) -> None:
        """Recompute a node's state from its current entry and reservation mask. Every writer changes its source
        first and refreshes after, and refreshes are serialised: the last one always sees the final sources."""
        with self._state_lock:
            entry = self.nodes.get(name)
            if entry is None:
                self.states.pop(name, None)
            else:
                st = self.state_for(entry, self.reservations.masks.get(name, 0))
                if self.states.get(name) is st:
                    return
                self.states[name] = st
            # after the state is written: a reader that kept an answer of the old state finds the new one when
            # it checks (extender.placement.engine), or its answer is forgotten here
            for forget in list(self.on_state_change):
                forget(name)

    def state_for(self, entry: NodeEntry, reserved: int) -> PlacementState:
        """The interned state of an entry (also for nodes seen only in a request's NodeList)."""
        if entry.topo is not None and entry.fingerprint not in self.topologies:
            self.topologies[entry.fingerprint] = entry.topo
        key = state_key(entry, reserved)
        st = self._interned.get(key)
        if st is None:
            if len(self._interned) >= _INTERN_LIMIT:
                self._interned = {}  # states in use stay valid; equal ones made later only miss the memos once
            st = self._interned.setdefault(key, PlacementState(key))
        return st

    def _report(self, key: str, problem: str | None, **fields: Any) -> None:
        if problem is None:
            self._reported.pop(key, None)
            return
        if self._reported.get(key) != problem:
            self._reported[key] = problem
            log.warning("extender.cache.ignored", what=key, problem=problem, **fields)

    def _bump(self) -> None:
        with self._changed:
            self.version += 1
            self._changed.notify_all()

    def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Block until predicate() holds after some change (or already holds); False on timeout."""
        with self._changed:
            return self._changed.wait_for(predicate, timeout)

    # -- nodes -----------------------------------------------------------------------------------------------

    def parse_topology(self, text: str) -> tuple[Topology | None, Mapping[str, int], str | None]:
        """Each distinct topology string is parsed once: thousands of nodes share a few."""
        hit = self._parsed_topologies.get(text)
        if hit is not None:
            return hit
        try:
            topo = topology_from_json(text)
            value: tuple[Topology | None, Mapping[str, int], str | None] = (
                topo, {g.id: g.index for g in topo.gpus}, None)
        except (TopologyError, RecursionError) as e:  # RecursionError: absurdly nested JSON
            value = (None, {}, f"GPU topology annotation {self.config.keys.topology} is unreadable: {e}")
        with self._topo_lock:
            if len(self._parsed_topologies) >= _TOPOLOGY_CACHE_LIMIT:
                self._parsed_topologies.clear()
            self._parsed_topologies[text] = value
        return value

    def entry_from_node(self, node: Mapping[str, Any]) -> NodeEntry:
        """Parse the fields of a Node dict that placement needs. Never raises on content."""
        meta = _dict(node.get("metadata"))
        name = str(meta.get("name") or "")
        ann = _dict(meta.get("annotations"))
        place = self.locality.place(_dict(meta.get("labels")))
        spec, status = _dict(node.get("spec")), _dict(node.get("status"))
        removal = autoscaler_taint(spec)
        unschedulable = spec.get("unschedulable") is True or removal in REMOVAL_TAINTS
        allocatable: int | None = None
        raw_alloc = _dict(status.get("allocatable")).get(self.config.resource_name)
        if raw_alloc is not None:
            try:
                allocatable = parse_quantity(raw_alloc, f"node {name} allocatable")
            except PodSpecError:
                allocatable = None
        text = ann.get(self.config.keys.topology)
        if not isinstance(text, str) or not text:
            entry = make_entry(name, None, unschedulable=unschedulable, place=place, removal=removal,
                               **self._mig_only(name, ann))
            self._report(f"node/{name}", None)
            return entry
        topo, index, problem = self.parse_topology(text)
        if topo is None:
            self._report(f"node/{name}", problem)
            return make_entry(name, None, problem=problem, unschedulable=unschedulable, place=place, removal=removal)
        used: frozenset[str] = frozenset()
        unhealthy: frozenset[str] = frozenset()
        sharing: NodeSharing | None = None
        mig: NodeMig | None = None
        generation = 0
        state_text = ann.get(self.config.keys.state)
        problem = None
        if isinstance(state_text, str) and state_text:
            try:
                state = state_from_json(state_text)
                used, unhealthy, generation = state.used, state.unhealthy, state.generation
                unknown = sorted((used | unhealthy) - index.keys())
                if state.sharing is not None:
                    sharing, dropped = node_sharing(state.sharing, index)
                    unknown = sorted(set(unknown) | set(dropped))
                if state.mig is not None:
                    mig = node_mig(state.mig)
                    unknown = sorted(set(unknown) - state.mig.used_ids - {i.uuid for g in state.mig.gpus
                                                                          for i in g.instances})
                if unknown:
                    self._report(f"node/{name}/ids", f"state names GPUs not in the topology: {unknown[:8]}")
            except (TopologyError, RecursionError) as e:
                problem = f"GPU state annotation {self.config.keys.state} is unreadable: {e}"
        elif state_text is not None:
            problem = f"GPU state annotation {self.config.keys.state} is not a string"
        self._report(f"node/{name}", problem)
        if problem is not None:
            return make_entry(name, None, problem=problem, unschedulable=unschedulable, place=place, removal=removal)
        return make_entry(name, topo, index=index, used=used, unhealthy=unhealthy, allocatable=allocatable,
                          unschedulable=unschedulable, generation=generation, place=place, sharing=sharing, mig=mig,
                          removal=removal)

    def _mig_only(self, name: str, ann: Mapping[str, Any]) -> dict[str, Any]:
        """A node without a topology may still offer MIG instances (every GPU MIG): its state's "mig" member, used
        and unhealthy ids. The node's problem says why it offers nothing else: no topology, or (its state naming
        MIG GPUs or not) an unreadable state, with the field the reader refused."""
        missing = f"publishes no GPU topology (annotation {self.config.keys.topology} missing)"
        text = ann.get(self.config.keys.state)
        if not isinstance(text, str) or not text:
            return {"problem": missing}
        try:
            state = state_from_json(text)
        except (TopologyError, RecursionError) as e:
            problem = f"GPU state annotation {self.config.keys.state} is unreadable: {e}"
            self._report(f"node/{name}/state", problem)
            return {"problem": problem}
        if state.mig is None:
            return {"problem": missing}
        return {"problem": missing, "mig": node_mig(state.mig), "used": state.used, "unhealthy": state.unhealthy,
                "generation": state.generation}

    def put_node(self, entry: NodeEntry) -> None:
        """Install a node entry; remaps reservations if its topology changed, settles those its state shows used.
        GPUs of gone pods that the entry still shows used count free (module docstring): those reservations settle
        only once the state shows them used again after showing them free."""
        with self.lock_for(entry.name):
            old = self.nodes.get(entry.name)
            self._published[entry.name] = entry
            entry = self._with_freed(entry)
            self.nodes[entry.name] = entry
            self._refresh_state(entry.name)
            if old is None or old.topo is not entry.topo:
                index = entry.index
                if entry.topo is not None:
                    dropped = self.reservations.remap(entry.name, index.get)
                    for r in dropped:
                        log.warning("extender.reservation.dropped", pod=f"{r.namespace}/{r.name}", node=r.node,
                                    why="planned GPUs are not in the node's new topology")
                    if dropped:
                        self.on_reservation_end("topology_changed", len(dropped))
            if (entry.topo is not None or entry.mig is not None) and (
                    old is None or (old.topo is None and old.mig is None)):
                self.on_node_usable(entry.name)
            self._note_shared(entry.name, entry.sharing.names if entry.sharing is not None else frozenset())
            counts = entry.sharing.used_by_id() if entry.sharing is not None else None
            if old is None and counts is not None:
                self.reservations.rebase_replicas(entry.name, counts)
            self._note_mig(entry.name, entry.mig.names if entry.mig is not None else frozenset())
            held = entry.used_ids | entry.mig.used if entry.mig is not None else entry.used_ids
            settled = self.reservations.settle(entry.name, held, counts,
                                               fell(old.sharing if old is not None else None, entry.sharing))
            for r in settled:
                self._settled[r.uid] = r.node
                log.debug("extender.reservation.settled", pod=f"{r.namespace}/{r.name}", node=r.node)
            if settled:
                self.on_reservation_end("settled", len(settled))
        self._bump()

    def _note_shared(self, node: str, names: frozenset[str]) -> None:
        """Keep `shared_names` (what pod parsing looks for) the union of what the nodes share."""
        if self._shared_by.get(node, frozenset()) == names:
            return
        with self._state_lock:
            if names:
                self._shared_by[node] = names
            else:
                self._shared_by.pop(node, None)
            self.shared_names = frozenset().union(*self._shared_by.values())

    def _note_mig(self, node: str, names: frozenset[str]) -> None:
        """Keep `mig_names` (what placement routes to MIG instances) the union of what the nodes advertise."""
        if self._mig_by.get(node, frozenset()) == names:
            return
        with self._state_lock:
            if names:
                self._mig_by[node] = names
            else:
                self._mig_by.pop(node, None)
            self.mig_names = frozenset().union(*self._mig_by.values())

    def shared_entry(self, node: str, resource: str) -> NodeEntry | None:
        """The node's entry when it shares `resource` as replicas."""
        entry = self.nodes.get(node)
        return entry if entry is not None and entry.shares(resource) else None

    def update_node(self, node: Mapping[str, Any]) -> NodeEntry | None:
        entry = self.entry_from_node(node)
        if not entry.name:
            return None
        self.put_node(entry)
        return entry

    def _with_freed(self, published: NodeEntry) -> NodeEntry:
        """The node's entry with the GPUs of gone pods that it still shows used counted free; forgets those it
        shows free by now, and those past FREED_TIMEOUT_S. The caller holds the node's lock."""
        freed = self._freed.get(published.name)
        if not freed:
            return published
        now = self.reservations.clock()
        keep = {g: until for g, until in freed.items() if g in published.used_ids and until > now}
        if keep:
            self._freed[published.name] = keep
        else:
            del self._freed[published.name]
        return without_used(published, keep)

    def _free_plan(self, rec: PodRecord) -> frozenset[str]:
        """The pod is gone: the whole GPUs of its plan that its node's state still shows used count free now."""
        plan = rec.plan
        if rec.node is None or plan is None or plan.node != rec.node:
            return frozenset()
        with self.lock_for(rec.node):
            published, entry = self._published.get(rec.node), self.nodes.get(rec.node)
            if published is None or entry is None or entry.topo is None:
                return frozenset()
            shared = entry.sharing.mask if entry.sharing is not None else 0
            ids = frozenset(i for i in plan.ids & entry.used_ids
                            if i in entry.index and not shared >> entry.index[i] & 1)
            if not ids:
                return ids
            until = self.reservations.clock() + FREED_TIMEOUT_S
            self._freed.setdefault(rec.node, {}).update(dict.fromkeys(ids, until))
            self.nodes[rec.node] = self._with_freed(published)
            self._refresh_state(rec.node)
        return ids

    def _expire_freed(self) -> None:
        for name in list(self._freed):
            with self.lock_for(name):
                published = self._published.get(name)
                if published is None:
                    self._freed.pop(name, None)
                    continue
                entry, current = self._with_freed(published), self.nodes.get(name)
                if current is None or entry.used_ids != current.used_ids:
                    self.nodes[name] = entry
                    self._refresh_state(name)

    def remove_node(self, name: str) -> None:
        with self.lock_for(name):
            self._published.pop(name, None)
            self._freed.pop(name, None)
            gone = self.nodes.pop(name, None)
            self._refresh_state(name)
            self._note_shared(name, frozenset())
            self._note_mig(name, frozenset())
        self._reported.pop(f"node/{name}", None)
        if gone is not None:
            self.on_node_removed(name)
        self._bump()

    def sync_nodes(self, items: Iterable[Any]) -> None:
        """Replace every node with a fresh snapshot (first list, or re-list after 410)."""
        seen = set()
        for item in items:
            if isinstance(item, dict):
                entry = self.update_node(item)
                if entry is not None:
                    seen.add(entry.name)
        for name in list(self.nodes):
            if name not in seen:
                self.remove_node(name)

    # -- pods ------------------------------------------------------------------------------------------------

    def record_from_pod(self, pod: Mapping[str, Any]) -> PodRecord | None:
        """The pod as far as GPUs go, or None when it neither asks for the resource nor carries a plan."""
        meta = _dict(pod.get("metadata"))
        uid = meta.get("uid")
        if not isinstance(uid, str) or not uid:
            return None
        namespace, name = str(meta.get("namespace") or "default"), str(meta.get("name") or "")
        ann = _dict(meta.get("annotations"))
        plan_text = ann.get(self.config.keys.plan)
        plan = None
        if plan_text is not None:
            try:
                plan = parse_plan(plan_text)
                self._report(f"pod/{uid}", None)
            except PlanFormatError as e:
                self._report(f"pod/{uid}", f"plan annotation ignored: {e}", pod=f"{namespace}/{name}")
        try:
            needs: PodNeeds | None = self.needs.of(pod, self.shared_names)
        except PodSpecError as e:
            self._report(f"pod/{uid}/spec", str(e), pod=f"{namespace}/{name}")
            needs = None
        if plan is None and (needs is None or needs.size == 0):
            return None
        spec, status = _dict(pod.get("spec")), _dict(pod.get("status"))
        node = spec.get("nodeName")
        priority = spec.get("priority")
        membership, membership_error = None, None
        try:
            membership = job_membership(pod, self.config.keys)
            self._report(f"pod/{uid}/job", None)
        except MembershipError as e:
            membership_error = str(e)
            self._report(f"pod/{uid}/job", f"job unreadable: {e}", pod=f"{namespace}/{name}")
        return PodRecord(uid, namespace, name, node if isinstance(node, str) and node else None,
                         str(status.get("phase") or ""), bool(meta.get("deletionTimestamp")), needs, plan,
                         plan_text if isinstance(plan_text, str) else None,
                         priority if isinstance(priority, int) and not isinstance(priority, bool) else 0,
                         membership, membership_error)

    def update_pod(self, pod: Mapping[str, Any]) -> PodRecord | None:
        """Record the pod (None when it holds no GPUs); a pod already seen gone stays gone: an event of it that
        arrives late (a watch behind a consistent list, a re-list older than a deletion) changes nothing."""
        if _uid_of(pod) in self._gone:
            return None
        rec = self.record_from_pod(pod)
        if rec is None:
            uid = _uid_of(pod)
            if uid is not None and uid in self.pods:
                self.remove_pod(uid, gone=False)
            return None
        with self._pods_lock:
            old = self.pods.get(rec.uid)
            self.pods[rec.uid] = rec
            gone = self.jobs.move(rec.uid, old.job_key if old is not None else None, rec.job_key)
        if gone is not None:
            self.on_job_gone(gone)
        self._reconcile(rec)
        self._bump()
        return rec

    def remove_pod(self, uid: str, *, gone: bool = True) -> None:
        """Forget the pod and end its reservations. `gone`: it was deleted or is terminal (not merely no longer a GPU
        pod): it is remembered as such, and the GPUs of its plan that its node still shows used count free."""
        with self._pods_lock:
            rec = self.pods.pop(uid, None)
            self._settled.pop(uid, None)
            if gone:
                self.needs.forget(uid)
                self._gone[uid] = None
                while len(self._gone) > GONE_LIMIT:
                    self._gone.popitem(last=False)
            job_gone = self.jobs.move(uid, rec.job_key, None) if rec is not None else None
        self._reported.pop(f"pod/{uid}", None)
        self._reported.pop(f"pod/{uid}/spec", None)
        self._reported.pop(f"pod/{uid}/job", None)
        released = self.reservations.release(uid)
        for r in released:
            log.debug("extender.reservation.released", pod=f"{r.namespace}/{r.name}", node=r.node, why="pod gone")
        if released:
            self.on_reservation_end("pod_gone", len(released))
        if gone and rec is not None:
            freed = self._free_plan(rec)
            if freed:
                log.info("extender.gpus.freed", pod=rec.key, node=rec.node, gpus=sorted(freed),
                         why="pod gone; its node's state still shows them used")
        if job_gone is not None:
            self.on_job_gone(job_gone)
        self._bump()

    def confirm_node_pods(self, node: str, read: Callable[[], Iterable[Any]]) -> list[str]:
        """`read()`: every pod bound to `node` as the apiserver has them now (a consistent list). Drop the pods the
        cache placed on the node before the read that are gone from it or terminal in it, and the reservations there
        bound before the read whose pods it does not list; the uids dropped. What the cache learns during the read
        is left alone (a pod bound meanwhile is not in the list yet). Pods being deleted that still run stay."""
        held = [rec.uid for rec in list(self.pods.values()) if rec.node == node]
        reserved = [r for r in self.reservations.on_node(node) if r.source != JOB and (r.bound or r.source == POD)]
        live: set[str] = set()
        for item in read():
            uid = _uid_of(item)
            if uid is not None and str(_dict(_dict(item).get("status")).get("phase") or "") not in TERMINAL_PHASES:
                live.add(uid)
        dropped = [uid for uid in held if uid not in live]
        for uid in dropped:
            self.remove_pod(uid)
        for r in reserved:
            if r.uid not in live and self.reservations.release_if(r.uid, node, r):
                with self._pods_lock:
                    self._gone[r.uid] = None
                self.on_reservation_end("pod_gone", 1)
                dropped.append(r.uid)
        if dropped:
            log.info("extender.pods.confirmed_gone", node=node, pods=len(dropped))
        return dropped

    def sync_pods(self, items: Iterable[Any]) -> None:
        """Replace every pod with a fresh snapshot. Reservations made by an in-flight bind are kept: their pod may
        postdate the snapshot; they end by state, deletion event or timeout. A bound one whose pod is not in the
        snapshot ends (its pod went away while the watch was down); were the pod only newer than the snapshot, its
        watch event rebuilds the reservation from its plan."""
        seen = set()
        for item in items:
            if isinstance(item, dict):
                rec = self.update_pod(item)
                if rec is not None:
                    seen.add(rec.uid)
        for uid in list(self.pods):
            if uid not in seen:
                self.remove_pod(uid)
        for r in self.reservations.all():
            if (r.source == POD or r.bound) and r.uid not in seen and self.reservations.release(r.uid, r.node):
                self.on_reservation_end("pod_gone", 1)

    def _reconcile(self, rec: PodRecord) -> None:
        """Keep the pod's reservation in line with its plan: rebuilt after a restart, dropped when it ends."""
        if rec.terminal:
            self.remove_pod(rec.uid)
            return
        plan = rec.plan
        if rec.node is None or plan is None:
            return
        if plan.node != rec.node:
            self._report(f"pod/{rec.uid}", f"plan is for node {plan.node}, pod is on {rec.node}", pod=rec.key)
            return
        for other in [r for r in self.reservations.of_pod(rec.uid) if r.node != rec.node]:
            self.reservations.release(other.uid, other.node)
        with self.lock_for(rec.node):
            if self.reservations.get(rec.uid, rec.node) is not None or self._settled.get(rec.uid) == rec.node:
                return
            ids = plan.ids
            entry = self.nodes.get(rec.node)
            if self._reconcile_mig(rec, plan, entry) or self._reconcile_shared(rec, plan, entry):
                return
            if entry is not None and entry.topo is not None:
                if ids <= entry.used_ids:
                    self._settled[rec.uid] = rec.node
                    return
                missing = [i for i in ids if i not in entry.index]
                if missing:
                    self._report(f"pod/{rec.uid}", f"plan names GPUs not on node {rec.node}: {sorted(missing)[:8]}",
                                 pod=rec.key)
                    return
                mask = mask_of(entry.index[i] for i in ids)
            else:
                mask = 0  # node not seen yet (pods listed first): the mask is computed when it arrives
            self.reservations.add(rec.uid, rec.namespace, rec.name, rec.node, ids, mask, POD, plan)
            log.info("extender.reservation.rebuilt", pod=rec.key, node=rec.node, gpus=sorted(ids))

    def _reconcile_shared(self, rec: PodRecord, plan: Plan, entry: NodeEntry | None) -> bool:
        """A shared plan's replicas, rebuilt after a restart (the caller holds the node's lock); False when the
        plan is not for replicas. A running pod was admitted, so the state counts its replicas already; a pending
        one may be in flight and is reserved (held too long at worst: extender.state.sharing)."""
        if entry is not None:
            if not entry.shares(plan.resource):
                return False
        elif plan.resource == self.config.resource_name:
            return False  # node unseen: only a renamed resource is known to be shared
        if rec.phase == "Running":
            self._settled[rec.uid] = rec.node or ""
            return True
        sharing = entry.sharing if entry is not None else None
        used = sharing.used_by_id() if sharing is not None else {}
        pending = self.reservations.pending_replicas(plan.node)
        self.reservations.add(rec.uid, rec.namespace, rec.name, plan.node, plan.ids, 0, POD, plan,
                              thresholds(plan.ids, used, pending))
        log.info("extender.reservation.rebuilt", pod=rec.key, node=plan.node, gpus=sorted(plan.ids), shared=True)
        return True

    def _reconcile_mig(self, rec: PodRecord, plan: Plan, entry: NodeEntry | None) -> bool:
        """A MIG plan's instances, rebuilt after a restart (the caller holds the node's lock); False when the plan
        is not for MIG instances. Settled at once when the node shows them held."""
        if not (is_mig_resource(plan.resource) or (entry is not None and entry.serves_mig(plan.resource))):
            return False
        if entry is not None and entry.mig is not None and plan.ids <= entry.mig.used:
            self._settled[rec.uid] = rec.node or ""
            return True
        self.reservations.add(rec.uid, rec.namespace, rec.name, plan.node, plan.ids, 0, POD, plan, instances=True)
        log.info("extender.reservation.rebuilt", pod=rec.key, node=plan.node, instances=sorted(plan.ids), mig=True)
        return True

    def _bound_here(self, r: Reservation) -> bool:
        """The reservation's pod is seen bound to its node and has not ended (it would have been removed)."""
        rec = self.pods.get(r.uid)
        return rec is not None and rec.node == r.node

    def expire_reservations(self) -> list[Reservation]:
        """End the reservations of pods never bound whose timeout passed (reservations module)."""
        self._expire_freed()
        gone = self.reservations.expire(self._bound_here)
        for r in gone:  # not marked settled: should its pod turn out bound after all, its plan is reserved again
            log.warning("extender.reservation.expired", pod=f"{r.namespace}/{r.name}", node=r.node,
                        gpus=sorted(r.ids), timeout_s=self.reservations.timeout_s)
        if gone:
            self.on_reservation_end("timeout", len(gone))
            self._bump()
        return gone

    def remember_pod(self, rec: PodRecord) -> None:
        """Record a pod placed without an apiserver (standalone mode); no reservation: the GPUs are marked used."""
        with self._pods_lock:
            old = self.pods.get(rec.uid)
            self.pods[rec.uid] = rec
            self.jobs.move(rec.uid, old.job_key if old is not None else None, rec.job_key)
