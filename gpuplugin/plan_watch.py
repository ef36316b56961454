"""The plugin's source of plans: pods bound to this node whose plan annotation the kubelet has not yet acted on.

The extender writes `<prefix>/plan` onto a pod in the same Binding that puts it on a node. When the kubelet later asks
GetPreferredAllocation it does not say which pod it is admitting, so this module keeps every pending plan of the node
in memory (from a pod watch) and answers with any container plan that has the requested size, lies inside the
kubelet's available set and holds every must-include id. Plans on one node are disjoint, so handing one pod another
same-size pod's plan costs nothing (DESIGN.md); once the kubelet allocates a plan its GPUs leave the available set,
which is why nothing has to be marked as used here.

The same watch tells when a pod holding this resource on the node ends (deleted, or Succeeded/Failed): it calls
`on_device_pod_ended`, so the node's published state frees its devices at once rather than at the next poll. Whether
a pod holds the resource is counted as the extender counts it (gputopo.podspec, one quantity parser for both).

The plan annotation codec is part of the shared contract (gputopo.contract).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import kubernetes.client
import structlog

from gpuplugin.deviceplugin.plans import PlanSource
from gpuplugin.metrics import PluginMetrics
from gputopo.contract import DEFAULT_KEYS, DEFAULT_RESOURCE, Keys, Plan, PlanFormatError, parse_plan
from gputopo.kube.watching import SYNC, Watcher
from gputopo.podspec import PodSpecError, pod_device_count

log = structlog.get_logger(__name__)

# Miss reasons, from "nothing to offer" to "almost": the reported reason is the furthest any plan got.
MISS_NO_PLANS = "no_pending_plans"
MISS_SIZE = "no_plan_of_size"
MISS_AVAILABLE = "not_available"
MISS_MUST_INCLUDE = "lacks_must_include"
_MISS_ORDER = (MISS_NO_PLANS, MISS_SIZE, MISS_AVAILABLE, MISS_MUST_INCLUDE)


@dataclass(frozen=True)
class PendingPlan:
    """One pod's plan waiting for the kubelet; `seq` orders pods by when this process first saw them planned."""

    uid: str
    namespace: str
    name: str
    seq: int
    plan: Plan


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


class PlanWatch:
    """A PlanSource (gpuplugin.deviceplugin.plans) fed by a watch on this node's pods."""

    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        node_name: str,
        *,
        keys: Keys = DEFAULT_KEYS,
        resource_name: str = DEFAULT_RESOURCE,
        watch_timeout_s: int = 300,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        metrics: PluginMetrics | None = None,
        on_device_pod_ended: Callable[[], None] | None = None,
        shared_resources: Callable[[], Collection[str]] | None = None,
    ) -> None:
        if not node_name:
            raise ValueError("node name must not be empty")
        self.node_name = node_name
        self.resource_name = resource_name
        # the shared resources served now (issue 22): their plans list parent GPU ids, asked through for_resource
        self._shared = shared_resources or (lambda: ())
        self.plan_key = keys.plan
        self._lock = threading.Lock()
        self._pending: dict[str, PendingPlan] = {}
        self._seq = 0
        self._metrics = metrics if metrics is not None else PluginMetrics()
        self._ignored: dict[str, str] = {}  # uid -> why, so a bad annotation is logged once, not per event
        self._holding: set[str] = set()  # uids of this node's live pods that ask for the resource
        self._on_ended = on_device_pod_ended
        self._watcher = Watcher(
            api,
            "pods",
            self._on_event,
            field_selector=f"spec.nodeName={node_name}",
            timeout_seconds=watch_timeout_s,
            backoff_initial_s=backoff_initial_s,
            backoff_max_s=backoff_max_s,
            name=f"plan-watch-{node_name}",
            metrics=self._metrics.watch,
        )
        self._log = log.bind(node=node_name)

    # -- lifecycle -------------------------------------------------------------------------------------------

    def start(self) -> PlanWatch:
        self._watcher.start()
        return self

    def stop(self) -> None:
        self._watcher.stop()

    def wait_synced(self, timeout: float | None = None) -> bool:
        return self._watcher.wait_synced(timeout)

    @property
    def synced(self) -> bool:
        return self._watcher.synced

    def __enter__(self) -> PlanWatch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def pending(self) -> list[PendingPlan]:
        """Pending plans, oldest first."""
        with self._lock:
            return sorted(self._pending.values(), key=lambda p: p.seq)

    # -- PlanSource ------------------------------------------------------------------------------------------

    def pending_plan(
        self, available_ids: Sequence[str], must_include_ids: Sequence[str], size: int
    ) -> list[str] | None:
        """A pending container plan of exactly `size` ids inside `available_ids` holding `must_include_ids`."""
        return self._plan_for(self.resource_name, available_ids, must_include_ids, size)

    def for_resource(self, resource: str) -> PlanSource:
        """The plan source of one shared resource: its plans' ids are parent GPUs (docs/contracts.md)."""
        return _ResourcePlans(self, resource)

    def _plan_for(
        self, resource: str, available_ids: Sequence[str], must_include_ids: Sequence[str], size: int
    ) -> list[str] | None:
        available = set(available_ids)
        must = set(must_include_ids)
        pending_now = [p for p in self.pending() if p.plan.resource == resource]
        furthest = 1 if pending_now else 0
        for pending in pending_now:
            for _container, ids in pending.plan.containers:
                if len(ids) != size:
                    continue
                furthest = max(furthest, 2)
                if not available.issuperset(ids):
                    continue
                if not must.issubset(ids):
                    furthest = 3
                    continue
                self._metrics.plan_lookups.labels("hit", "").inc()
                self._log.debug("plugin.plans.hit", pod=f"{pending.namespace}/{pending.name}", ids=list(ids))
                return list(ids)
        reason = _MISS_ORDER[furthest]
        self._metrics.plan_lookups.labels("miss", reason).inc()
        self._log.debug("plugin.plans.miss", reason=reason, size=size, available=len(available), must=len(must))
        return None

    # -- watch -----------------------------------------------------------------------------------------------

    def _holds_devices(self, pod: Mapping[str, Any]) -> bool:
        """A live pod of this node that asks for the resource (so holds, or will hold, some of its devices)."""
        spec = pod.get("spec") if isinstance(pod.get("spec"), dict) else {}
        status = pod.get("status") if isinstance(pod.get("status"), dict) else {}
        if spec.get("nodeName") != self.node_name or status.get("phase") in ("Succeeded", "Failed"):
            return False
        try:
            return any(pod_device_count(pod, r) > 0 for r in (self.resource_name, *self._shared()))
        except PodSpecError:
            return False

    def _ended(self, uids: set[str]) -> None:
        if uids and self._on_ended is not None:
            self._log.debug("plugin.pods.ended", pods=len(uids))
            try:
                self._on_ended()
            except Exception:  # the watch must go on whatever the callback does
                self._log.exception("plugin.pods.refresh_failed")

    def _follow_holding(self, event_type: str, obj: dict[str, Any]) -> None:
        if event_type == SYNC:
            now = set()
            for pod in obj.get("items") or []:
                uid = _meta(pod).get("uid") if isinstance(pod, dict) else None
                if isinstance(uid, str) and self._holds_devices(pod):
                    now.add(uid)
            ended, self._holding = self._holding - now, now
            self._ended(ended)
            return
        uid = _meta(obj).get("uid")
        if not isinstance(uid, str):
            return
        if event_type != "DELETED" and self._holds_devices(obj):
            self._holding.add(uid)
        elif uid in self._holding:
            self._holding.discard(uid)
            self._ended({uid})

    def _on_event(self, event_type: str, obj: dict[str, Any]) -> None:
        self._follow_holding(event_type, obj)
        if event_type == SYNC:
            items = obj.get("items") or []
            seen = set()
            for pod in items:
                if isinstance(pod, dict):
                    uid = self._update(pod)
                    if uid:
                        seen.add(uid)
            with self._lock:
                for uid in list(self._pending):
                    if uid not in seen:
                        del self._pending[uid]
                self._ignored = {u: w for u, w in self._ignored.items() if u in seen}
        elif event_type == "DELETED":
            uid = _meta(obj).get("uid")
            with self._lock:
                self._pending.pop(uid, None)
                self._ignored.pop(uid, None)
        else:
            self._update(obj)
        self._metrics.pending_plans.set(len(self._pending))

    def _update(self, pod: dict[str, Any]) -> str | None:
        meta = _meta(pod)
        uid = meta.get("uid")
        if not isinstance(uid, str) or not uid:
            return None
        plan, why = self._pending_plan_of(pod, meta)
        with self._lock:
            if plan is None:
                self._pending.pop(uid, None)
                if why and self._ignored.get(uid) != why:
                    self._ignored[uid] = why
                    self._metrics.plans_ignored.labels(why.split(":", 1)[0]).inc()
                    self._log.warning(
                        "plugin.plans.ignored", pod=f"{meta.get('namespace')}/{meta.get('name')}", why=why
                    )
                return uid
            self._ignored.pop(uid, None)
            old = self._pending.get(uid)
            if old is not None and old.plan == plan:
                return uid
            self._seq += 1
            self._pending[uid] = PendingPlan(
                uid, str(meta.get("namespace", "")), str(meta.get("name", "")), old.seq if old else self._seq, plan
            )
        return uid

    def _pending_plan_of(self, pod: dict[str, Any], meta: Mapping[str, Any]) -> tuple[Plan | None, str]:
        """The pod's plan if it is still waiting for the kubelet; else None and why (empty: nothing to report)."""
        annotations = meta.get("annotations")
        text = annotations.get(self.plan_key) if isinstance(annotations, dict) else None
        if text is None:
            return None, ""
        spec = pod.get("spec") if isinstance(pod.get("spec"), dict) else {}
        status = pod.get("status") if isinstance(pod.get("status"), dict) else {}
        if spec.get("nodeName") != self.node_name:
            return None, ""
        if meta.get("deletionTimestamp") or status.get("phase") not in (None, "", "Pending"):
            return None, ""  # started, finished or going away: the kubelet has acted or never will
        try:
            plan = parse_plan(text)
        except PlanFormatError as e:
            return None, f"garbage: {e}"
        if plan.node != self.node_name:
            return None, f"other_node: plan is for node {plan.node!r}"
        if plan.resource != self.resource_name and plan.resource not in self._shared():
            return None, f"other_resource: plan is for {plan.resource!r}"
        return plan, ""


class _ResourcePlans:
    """PlanWatch's plans of one shared resource, as a PlanSource."""

    def __init__(self, watch: PlanWatch, resource: str) -> None:
        self._watch = watch
        self.resource = resource

    def pending_plan(
        self, available_ids: Sequence[str], must_include_ids: Sequence[str], size: int
    ) -> list[str] | None:
        return self._watch._plan_for(self.resource, available_ids, must_include_ids, size)
