"""Keeps this node's ResourceSlices equal to what the pool should hold, through the official client.

One `Worker`. Anything that may change the pool (a prepare or unprepare, a health change, a watch event on our
slices: the kubelet deletes all of its node's slices at start, and a driver's after 30 s without a connected
plugin) asks for a sync; syncs run at most once per `min_interval_s`, requests that arrive meanwhile fold into the
next one, and with no request a sync still runs every `resync_s`. A sync lists our slices (the server's truth, not
a cache), asks gpuplugin.dra.pool for the wanted contents and gpuplugin.dra.sync for the safe order of writes, and
makes them. A failed sync (a conflict with someone else's change, the apiserver away) is logged and retried after
the shared `Backoff`, which requests do not cut short.

The GPUs the order treats as used are the prepared claims' (the driver's state) and, with `watch_claims`, those
of every claim whose status.allocation names a device of this pool, from a watch on ResourceClaims: the scheduler
writes the allocation when it binds the pod, seconds before the kubelet prepares it (pod start), so a pod that
follows is offered an order for what is really free, not one step stale. Claims cannot be selected by node on the
server, so the watch spans the cluster and keeps only this pool's devices; where RBAC does not grant list and
watch on resourceclaims, the order follows prepares only (said once in the log).

Shared GPUs (consumable capacity) are published only where the apiserver takes them: a write of a slice holding
multi-allocatable devices that fails with 422 Invalid, or that comes back without `allowMultipleAllocations` or
without the request policies (the apiserver drops the fields of a disabled feature gate), makes the pool fall back
to whole GPUs (PoolPlanner.fall_back), logged as an error `dra.capacity.refused` with the apiserver's words,
counted in gpuplugin_dra_capacity_refusals_total{reason} and shown by gpuplugin_dra_consumable_capacity = 0.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Self

import kubernetes.client
import structlog

from gpuplugin.dra.claims import allocated_here, claim_ref
from gpuplugin.dra.errors import CapacityRefused
from gpuplugin.dra.metrics import DraMetrics
from gpuplugin.dra.pool import PoolPlanner
from gpuplugin.dra.slices import parse_slice_index, slice_name_prefix
from gpuplugin.dra.sync import Write, observed_from, plan
from gputopo.kube import SYNC, Watcher, get_node, list_objects
from gputopo.kube.dra import create_slice, delete_slice, replace_slice
from gputopo.kube.errors import Invalid, KubeApiError
from gputopo.kube.fetching import ApiResource
from gputopo.retry import Backoff
from gputopo.workers import Worker

log = structlog.get_logger(__name__)

StateFn = Callable[[], tuple[set[int], set[int]]]  # -> (used GPUs, unhealthy GPUs)
CLAIMS = ApiResource("resource.k8s.io", "v1", "resourceclaims", "ResourceClaim")
CLAIMS_ABSENT_RETRY_S = 300.0


class SlicePublisher(Worker):
    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        planner: PoolPlanner,
        state: StateFn,
        *,
        driver: str,
        node: str,
        metrics: DraMetrics | None = None,
        min_interval_s: float = 0.2,
        resync_s: float = 300.0,
        backoff_initial_s: float = 0.2,
        backoff_max_s: float = 30.0,
        watch_claims: bool = True,
    ) -> None:
        super().__init__("dra-publisher", join_timeout_s=10.0)
        self.api = api
        self.planner = planner
        self.state = state
        self.driver = driver
        self.node = node
        self.metrics = metrics if metrics is not None else DraMetrics()
        self.min_interval_s = min_interval_s
        self.resync_s = resync_s
        self.selector = f"spec.driver={driver},spec.nodeName={node}"
        self.syncs = 0  # completed syncs (written or already current)
        self._backoff = Backoff(backoff_initial_s, backoff_max_s)
        self._last_sync = float("-inf")
        self._owner: list[dict[str, Any]] | None = None
        self._cond = threading.Condition()
        self._watcher: Watcher | None = None
        self.watch_claims = watch_claims
        self._claim_watcher: Watcher | None = None
        self._allocated: dict[str, frozenset[str]] = {}  # claim UID -> our devices in its allocation
        self._allocated_lock = threading.Lock()
        self._adopted = False
        self._sync_lock = threading.Lock()  # one sync at a time (the thread's, or a caller's)
        self.metrics.consumable_capacity.set(1 if planner.shares_capacity else 0)

    def start(self) -> Self:
        self._owner = self._node_owner()
        self._watcher = Watcher(self.api, "resourceslices", self._on_event, field_selector=self.selector,
                                name=f"watch-slices-{self.node}", metrics=self.metrics.watch)
        self._watcher.start()
        if self.watch_claims:
            self._claim_watcher = Watcher(self.api, CLAIMS, self._on_claim, name=f"watch-claims-{self.node}",
                                          metrics=self.metrics.watch, absent_retry_s=CLAIMS_ABSENT_RETRY_S)
            self._claim_watcher.start()
        return super().start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the watches (no more requests), then the loop. Safe to call twice."""
        for watcher in (self._watcher, self._claim_watcher):
            if watcher is not None:
                watcher.stop()
        super().stop(timeout)

    def allocated_gpus(self) -> set[int]:
        """GPUs of this pool's devices that claims are allocated, as the claim watch last saw them."""
        devices = self.planner.catalog.devices
        with self._allocated_lock:
            names = {n for held in self._allocated.values() for n in held if n in devices}
        return self.planner.catalog.gpus_of(names)

    def request(self) -> None:
        """Ask for a sync (cheap; folds into the next one)."""
        self.wake()

    def wait_syncs(self, count: int, timeout: float) -> bool:
        """Block until `count` syncs have completed."""
        with self._cond:
            return self._cond.wait_for(lambda: self.syncs >= count, timeout)

    # ---- thread ----

    def _on_event(self, event_type: str, obj: dict[str, Any]) -> None:
        if event_type in ("SYNC", "DELETED", "MODIFIED", "ADDED"):
            self.request()

    def _on_claim(self, event_type: str, obj: dict[str, Any]) -> None:
        if event_type == SYNC:
            items = [o for o in obj.get("items") or () if isinstance(o, dict)]
            fresh = {uid: held for o in items
                     if (uid := (o.get("metadata") or {}).get("uid")) and (held := self._ours(o))}
        with self._allocated_lock:
            before = set().union(*self._allocated.values())
            if event_type == SYNC:
                self._allocated = fresh
            else:
                uid = (obj.get("metadata") or {}).get("uid")
                held = self._ours(obj) if event_type != "DELETED" else frozenset()
                if uid and held:
                    self._allocated[uid] = held
                elif uid:
                    self._allocated.pop(uid, None)
            after = set().union(*self._allocated.values())
        if before != after:
            log.debug("dra.allocations.changed", claim=claim_ref(obj) if event_type != SYNC else None,
                      allocated=len(after))
            self.request()

    def _ours(self, claim: dict[str, Any]) -> frozenset[str]:
        return allocated_here(claim, self.driver, self.node)

    def loop(self) -> None:
        delay, wakeable = 0.0, True
        while not self.pause(delay, wakeable=wakeable):
            wait = self.min_interval_s - (time.monotonic() - self._last_sync)
            if wait > 0 and self.pause(wait, wakeable=False):  # coalesce whatever arrives meanwhile
                return
            self._last_sync = time.monotonic()
            try:
                self.sync()
            except Exception as e:
                self.metrics.publish_failures.inc()
                delay, wakeable = self._backoff.failed(), False
                if isinstance(e, KubeApiError):
                    log.warning("dra.publish.failed", error=str(e), retry_in_s=round(delay, 2))
                else:
                    log.exception("dra.publish.crashed", retry_in_s=round(delay, 2))
                continue
            self._backoff.reset()
            delay, wakeable = self.resync_s, True

    def sync(self) -> list[Write]:
        """One pass: read our slices, write what differs. Returns the writes made."""
        with self._sync_lock:
            return self._sync()

    def _sync(self) -> list[Write]:
        started = time.perf_counter()
        items, _ = list_objects(self.api, "resourceslices", field_selector=self.selector)
        observed = [observed_from(o) for o in items]
        if not self._adopted:
            self._adopt(items)
        used, unhealthy = self.state()
        used = set(used) | self.allocated_gpus()
        writes = plan(observed, self.planner.wanted(used, unhealthy), driver=self.driver, node=self.node)
        try:
            for w in writes:
                self._apply(w)
        except CapacityRefused as e:
            self.metrics.capacity_refusals.labels(reason=e.reason).inc()
            if not self.planner.fall_back():
                log.error("dra.capacity.refused", error=str(e), reason=e.reason,
                          consequence="cannot fall back to whole GPUs (a claim holds a shared GPU, or no fallback)")
                raise
            self.metrics.consumable_capacity.set(0)
            log.error("dra.capacity.refused", error=str(e), reason=e.reason,
                      consequence="shared GPUs are published as whole GPUs from now on; enable the "
                                  "DRAConsumableCapacity feature gate (apiserver, scheduler, kubelet; Kubernetes "
                                  "1.34+) or run with --no-consumable-capacity")
            return self._sync()
        if writes:
            old = max((o.generation for o in observed), default=0)
            same = all(w.body is None or w.body["spec"]["pool"]["generation"] == old for w in writes)
            mode = "in_place" if observed and same else "generation"
            self.metrics.publishes.labels(mode=mode).inc()
            self.metrics.publish_seconds.observe(time.perf_counter() - started)
            log.info("dra.pool.published", writes=len(writes), mode=mode,
                     generation=max((w.body["spec"]["pool"]["generation"] for w in writes if w.body), default=None))
        with self._cond:
            self.syncs += 1
            self._cond.notify_all()
        return writes

    def _adopt(self, items: list[dict[str, Any]]) -> None:
        """Start from the layout on the server, so a restarted driver keeps updating in place where it can."""
        by_index = {}
        for o in items:
            index = parse_slice_index(o["metadata"]["name"], self.driver, self.node)
            if index is not None:
                by_index[index] = observed_from(o).content
        if by_index and sorted(by_index) == list(range(len(by_index))):
            self.planner.adopt([by_index[i] for i in range(len(by_index))])
        self._adopted = True

    def _apply(self, w: Write) -> None:
        if w.op == "delete":
            assert w.name is not None
            delete_slice(self.api, w.name)
            return
        assert w.body is not None and w.index is not None
        meta: dict[str, Any] = {}
        if self._owner:
            meta["ownerReferences"] = self._owner
        try:
            if w.op == "create":
                meta["generateName"] = slice_name_prefix(w.index, self.driver, self.node)
                got = create_slice(self.api, {**w.body, "metadata": meta})
            else:
                assert w.name is not None
                meta.update(name=w.name, resourceVersion=w.resource_version)
                got = replace_slice(self.api, w.name, {**w.body, "metadata": meta})
        except Invalid as e:
            if _multi(w.body):
                raise CapacityRefused(f"the apiserver refused a slice with shared GPUs: {e.message}", "invalid") from e
            raise
        dropped = _dropped(w.body, got)
        if dropped:
            raise CapacityRefused(f"the apiserver stored shared GPUs {dropped[:4]} without allowMultipleAllocations "
                                  "or their request policies (the DRAConsumableCapacity gate is off there)", "dropped")

    def _node_owner(self) -> list[dict[str, Any]] | None:
        """The Node as controller owner, so slices go with a deleted Node; None (said once) when unreadable."""
        try:
            node = get_node(self.api, self.node)
        except KubeApiError as e:
            log.warning("dra.node.unreadable", node=self.node, error=str(e),
                        consequence="slices without a Node owner")
            return None
        return [{"apiVersion": "v1", "kind": "Node", "name": self.node, "uid": node["metadata"]["uid"],
                 "controller": True}]


def _multi(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [d for d in body["spec"].get("devices") or () if d.get("allowMultipleAllocations")]


def _dropped(sent: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """Names of multi-allocatable devices we sent that came back without that flag or a request policy."""
    back = {d.get("name"): d for d in (got.get("spec") or {}).get("devices") or () if isinstance(d, dict)}
    out = []
    for d in _multi(sent):
        b = back.get(d["name"]) or {}
        policies = [k for k, c in (d.get("capacity") or {}).items() if "requestPolicy" in c]
        kept = b.get("allowMultipleAllocations") is True and all(
            "requestPolicy" in ((b.get("capacity") or {}).get(k) or {}) for k in policies)
        if not kept:
            out.append(d["name"])
    return out
