"""GPUs promised to pods that are bound (or being bound) but not yet shown as used in their node's state.

Between the extender's bind and the plugin republishing the node's state there is a window in which the node's
annotation still shows the planned GPUs free. A reservation closes it: the node's free set is topology - used -
unhealthy - reserved. A reservation ends when the node's state shows all its GPUs used, or when its pod is gone
(deleted, or terminal). A timeout ends only the reservations of pods that were never bound (a Binding whose outcome
is unknown and that the apiserver never applied): a bound pod whose kubelet is slow or down keeps its GPUs for as
long as it lives, however long that takes, since giving them away would plan a second pod onto them.

A job plan (extender.jobs.plans) reserves its slots the same way, one reservation per slot held by the job (a holder
id that is no pod's uid), so nothing else is planned onto them; they end by the timeout unless a pod takes them.

Reservations are keyed by (pod uid, node): two binds of one pod to different nodes never overwrite each other.
Masks are bit sets of GPU indices on the node's current topology; ids stay the truth, so a node whose topology
changes gets its masks recomputed.

A MIG plan (issue 23) reserves its MIG UUIDs (`instances`, mask 0: a MIG GPU is never offered whole); it settles
when the node's state shows them held (extender.state.mig).

A shared plan (replicas of shared GPUs, issue 22) reserves one replica on each of its GPUs instead: its mask is 0
(a shared GPU is never offered whole) and `replicas` holds, per GPU id, the used count that shows it held; it
settles when the node's state reaches all of them (extender.state.sharing says why counts, and how they move).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from gputopo.contract import Plan

BIND, POD, JOB = "bind", "pod", "job"


@dataclass(frozen=True)
class Reservation:
    uid: str
    namespace: str
    name: str
    node: str
    ids: frozenset[str]
    mask: int
    expires_at: float
    source: str  # BIND: made by this process's bind; POD: rebuilt from a pod's plan annotation; JOB: a job's slot
    plan: Plan | None = None
    bound: bool = False  # the Binding was applied: the timeout no longer applies
    replicas: tuple[tuple[str, int], ...] = ()  # a shared plan: (gpu id, used count that shows it held)
    instances: bool = False  # a MIG plan: `ids` are MIG UUIDs, mask 0; settles when the state shows them held


class Reservations:
    """Thread-safe store; `masks` is read lock-free by the filter hot path (dict reads are atomic)."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self._lock = threading.Lock()
        self._by_node: dict[str, dict[str, Reservation]] = {}
        # uid -> the nodes it is reserved on: a pod's own reservations without a scan of every one (a restart
        # rebuilds tens of thousands, one pod event at a time)
        self._nodes_of: dict[str, set[str]] = {}
        self.masks: dict[str, int] = {}
        self.on_change: Callable[[str], None] = lambda node: None  # called (under the lock) after a mask changes

    def _pop(self, held: dict[str, Reservation], uid: str, node: str) -> Reservation:
        """Remove one reservation (the caller holds the lock and recomputes the node's mask)."""
        nodes = self._nodes_of.get(uid)
        if nodes is not None:
            nodes.discard(node)
            if not nodes:
                del self._nodes_of[uid]
        return held.pop(uid)

    def _recompute(self, node: str) -> None:
        held = self._by_node.get(node)
        if not held:
            self._by_node.pop(node, None)
            self.masks.pop(node, None)
        else:
            mask = 0
            for r in held.values():
                mask |= r.mask
            self.masks[node] = mask
        self.on_change(node)

    def add(self, uid: str, namespace: str, name: str, node: str, ids: Iterable[str], mask: int,
            source: str, plan: Plan | None = None, replicas: tuple[tuple[str, int], ...] = (),
            instances: bool = False) -> Reservation:
        res = Reservation(uid, namespace, name, node, frozenset(ids), mask, self.clock() + self.timeout_s, source,
                          plan, replicas=replicas, instances=instances)
        with self._lock:
            self._by_node.setdefault(node, {})[uid] = res
            self._nodes_of.setdefault(uid, set()).add(node)
            self._recompute(node)
        return res

    def mark_bound(self, uid: str, node: str, expected: Reservation) -> bool:
        """The Binding of `expected` was applied: it now ends only by state or by its pod going away."""
        with self._lock:
            held = self._by_node.get(node)
            if held and held.get(uid) is expected:
                held[uid] = replace(expected, bound=True)
                return True
        return False

    def get(self, uid: str, node: str) -> Reservation | None:
        return self._by_node.get(node, {}).get(uid)

    def on_node(self, node: str) -> list[Reservation]:
        with self._lock:
            return list(self._by_node.get(node, {}).values())

    def of_pod(self, uid: str) -> list[Reservation]:
        """The pod's reservations, whatever their nodes."""
        with self._lock:
            return [self._by_node[n][uid] for n in self._nodes_of.get(uid, ())]

    def all(self) -> list[Reservation]:
        with self._lock:
            return [r for held in self._by_node.values() for r in held.values()]

    def count(self) -> int:
        with self._lock:
            return sum(len(h) for h in self._by_node.values())

    def release(self, uid: str, node: str | None = None) -> list[Reservation]:
        """Drop the pod's reservation on `node` (every node when None)."""
        out = []
        with self._lock:
            nodes = [node] if node is not None else list(self._nodes_of.get(uid, ()))
            for n in nodes:
                held = self._by_node.get(n)
                if held and uid in held:
                    out.append(self._pop(held, uid, n))
                    self._recompute(n)
        return out

    def release_if(self, uid: str, node: str, expected: Reservation) -> bool:
        """Drop the reservation only if it is still the one the caller made (a retry may have replaced it)."""
        with self._lock:
            held = self._by_node.get(node)
            if held and held.get(uid) is expected:
                self._pop(held, uid, node)
                self._recompute(node)
                return True
        return False

    def pending_replicas(self, node: str) -> dict[str, int]:
        """Per GPU id, the replicas that shared plans in flight hold on the node."""
        out: dict[str, int] = {}
        with self._lock:
            for r in self._by_node.get(node, {}).values():
                for gpu, _ in r.replicas:
                    out[gpu] = out.get(gpu, 0) + 1
        return out

    def pending_instances(self, node: str) -> frozenset[str]:
        """The MIG UUIDs that MIG plans in flight hold on the node."""
        with self._lock:
            return frozenset(i for r in self._by_node.get(node, {}).values() if r.instances for i in r.ids)

    def rebase_replicas(self, node: str, shared_used: Mapping[str, int]) -> None:
        """A node seen for the first time: shared reservations made before (rebuilt from plans while the node was
        unknown) wait for the counts it shows now plus their own, in the order they were made."""
        with self._lock:
            held = self._by_node.get(node)
            if not held:
                return
            ahead: dict[str, int] = {}
            for uid, r in list(held.items()):
                if not r.replicas:
                    continue
                new = []
                for g, _ in r.replicas:
                    ahead[g] = ahead.get(g, 0) + 1
                    new.append((g, shared_used.get(g, 0) + ahead[g]))
                held[uid] = replace(r, replicas=tuple(new))

    def settle(self, node: str, used_ids: frozenset[str], shared_used: Mapping[str, int] | None = None,
               fell: Mapping[str, int] | None = None) -> list[Reservation]:
        """End the node's reservations whose GPUs its state now shows used; shared ones (`replicas`) when each GPU's
        used count in `shared_used` reaches theirs, after lowering those by what `fell` says pods freed."""
        out = []
        with self._lock:
            held = self._by_node.get(node)
            if not held:
                return out
            for uid, r in list(held.items()):
                if r.replicas:
                    if fell:
                        r = held[uid] = replace(r, replicas=tuple((g, max(1, t - fell.get(g, 0)))
                                                                  for g, t in r.replicas))
                    if shared_used is not None and all(shared_used.get(g, 0) >= t for g, t in r.replicas):
                        out.append(self._pop(held, uid, node))
                elif r.ids <= used_ids:
                    out.append(self._pop(held, uid, node))
            if out:
                self._recompute(node)
        return out

    def remap(self, node: str, index_of: Callable[[str], int | None]) -> list[Reservation]:
        """Recompute masks after the node's topology changed; reservations naming unknown GPUs are dropped."""
        dropped = []
        with self._lock:
            held = self._by_node.get(node)
            if not held:
                return dropped
            for uid, r in list(held.items()):
                if r.instances:  # MIG UUIDs: not in the topology, nothing to remap
                    continue
                idx = [index_of(i) for i in r.ids]
                if r.replicas:  # counted per GPU id, no mask to redo
                    if any(i is None for i in idx):
                        dropped.append(self._pop(held, uid, node))
                    continue
                if any(i is None for i in idx):
                    dropped.append(self._pop(held, uid, node))
                    continue
                mask = 0
                for i in idx:
                    mask |= 1 << i  # type: ignore[operator]
                held[uid] = replace(r, mask=mask)
            self._recompute(node)
        return dropped

    def expire(self, bound: Callable[[Reservation], bool] = lambda r: False,
               now: float | None = None) -> list[Reservation]:
        """End the reservations past their timeout, except those marked bound or for which `bound(r)` holds (the
        caller knows the pod sits on that node)."""
        now = self.clock() if now is None else now
        out = []
        with self._lock:
            for node, held in list(self._by_node.items()):
                gone = [uid for uid, r in held.items() if r.expires_at <= now and not r.bound and not bound(r)]
                for uid in gone:
                    out.append(self._pop(held, uid, node))
                if gone:
                    self._recompute(node)
        return out
