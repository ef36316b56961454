"""The plugin's source of plans: pods bound to this node whose plan annotation the kubelet has not yet acted on.

The extender writes `<prefix>/plan` onto a pod in the same Binding that puts it on a node. When the kubelet later asks
GetPreferredAllocation it does not say which pod it is admitting, so this module keeps every pending plan of the node
in memory (from a pod watch) and works out which pod the question is for. A plan is handed only to the pod it was
made for: handing one pod another's plan piles shared replicas onto GPUs already in use while the planned ones stay
idle, and leaves every annotation on the node wrong.

Which pod: the kubelet admits pods one at a time, adding each to its pod manager just before admitting it, and
allocates a pod's containers in order (init containers, then the others). So the pod being admitted is the one the
kubelet's PodResources List shows with no devices yet for the next container of its plan; the same List shows which
containers already hold devices (also after this process restarts). When List cannot be read within a short bound,
the plugin follows the kubelet's own order: pods by creation time, then by when this process first saw them, each
container once (a container whose plan was handed out is not offered again).

The same watch tells when a pod holding this resource on the node ends (deleted, or Succeeded/Failed): it calls
`on_device_pod_ended`, so the node's published state frees its devices at once rather than at the next poll. Whether
a pod holds the resource is counted as the extender counts it (gputopo.podspec, one quantity parser for both).

The plan annotation codec is part of the shared contract (gputopo.contract).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import kubernetes.client
import structlog

from gpuplugin.deviceplugin.plans import PlanSource
from gpuplugin.metrics import PluginMetrics
from gputopo.contract import DEFAULT_KEYS, DEFAULT_RESOURCE, Keys, Plan, PlanFormatError, parse_plan
from gputopo.kube.watching import SYNC, Watcher
from gputopo.podspec import PodSpecError, pod_device_count

# The kubelet's view: (namespace, pod) -> container -> resource -> device ids (gpuplugin.podresources.KubeletPods).
KubeletView = Mapping[tuple[str, str], Mapping[str, Mapping[str, Sequence[str]]]]

log = structlog.get_logger(__name__)

# Miss reasons, from "nothing to offer" to "almost": the reported reason is the furthest any plan got.
MISS_NO_PLANS = "no_pending_plans"
MISS_SIZE = "no_plan_of_size"
MISS_AVAILABLE = "not_available"
MISS_MUST_INCLUDE = "lacks_must_include"
_MISS_ORDER = (MISS_NO_PLANS, MISS_SIZE, MISS_AVAILABLE, MISS_MUST_INCLUDE)
MISS_NOT_ADMITTING = "not_admitting"  # plans fit, but the kubelet does not list their pods: it admits another
# How long the kubelet's PodResources List may take while the kubelet waits for GetPreferredAllocation.
KUBELET_VIEW_TIMEOUT_S = 0.5
# How long a question waits for this watch to deliver a pod the kubelet is already admitting (both watch the same
# apiserver; the kubelet can be first). The kubelet waits for the answer, so this bounds a rare delay.
WATCH_LAG_WAIT_S = 1.0


@dataclass(frozen=True)
class PendingPlan:
    """One pod's plan waiting for the kubelet, its containers in the kubelet's allocation order.

    `created` (the pod's creationTimestamp, RFC 3339 so it sorts as text) and then `seq` (when this process first
    saw the pod planned) order pods as the kubelet admits them."""

    uid: str
    namespace: str
    name: str
    seq: int
    plan: Plan
    created: str = ""

    @property
    def kubelet_order(self) -> tuple[str, int]:
        return (self.created, self.seq)


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
        kubelet_view: Callable[[], KubeletView] | None = None,
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
        # the kubelet's PodResources List, read when a plan is asked for (None: follow the kubelet's order alone)
        self._kubelet_view = kubelet_view
        self._handed: dict[str, set[str]] = {}  # uid -> containers whose plan went to the kubelet
        self._view_failed = False  # so a failing List is said once per outage, not per admission
        self._known: set[tuple[str, str]] = set()  # (namespace, name) of this node's pods the watch has delivered
        self._given_up: set[tuple[str, str]] = set()  # listed by the kubelet, waited for once, never delivered
        self._delivered = threading.Condition(self._lock)
        self.watch_lag_wait_s = WATCH_LAG_WAIT_S
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
        """Pending plans in the kubelet's admission order."""
        with self._lock:
            return sorted(self._pending.values(), key=lambda p: p.kubelet_order)

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
        view = self._read_kubelet_view()
        if view is not None:
            self._caught_up(view)
        # read after the kubelet's List: every pod it lists as being admitted is in it, or was waited for
        pending_now = [p for p in self.pending() if p.plan.resource == resource]
        if view is not None:
            self._mark_held(pending_now, resource, view)
        furthest, fits = self._fitting(pending_now, available, must, size)
        if view is not None:
            # the kubelet lists a pod from just before its admission: an unlisted pod is not the one it admits
            listed = [f for f in fits if (f[0].namespace, f[0].name) in view]
            if fits and not listed:
                furthest = len(_MISS_ORDER)
            fits = listed
        if fits:
            pending, container, ids = fits[0]
            with self._lock:
                if pending.uid in self._pending:
                    self._handed.setdefault(pending.uid, set()).add(container)
            self._metrics.plan_lookups.labels("hit", "").inc()
            self._log.debug("plugin.plans.hit", pod=f"{pending.namespace}/{pending.name}", container=container,
                            ids=list(ids), candidates=len(fits))
            return list(ids)
        reason = MISS_NOT_ADMITTING if furthest == len(_MISS_ORDER) else _MISS_ORDER[furthest]
        self._metrics.plan_lookups.labels("miss", reason).inc()
        self._log.debug("plugin.plans.miss", reason=reason, size=size, available=len(available), must=len(must))
        return None

    def _caught_up(self, view: KubeletView) -> None:
        """Wait (bounded) for this watch to deliver the pods the kubelet lists holding nothing that it has not
        delivered yet: the pod being admitted may be one of them, its plan still on the way. A listed pod that
        never comes (deleted from the API, still ending on the node) is waited for once only."""

        def missing() -> set[tuple[str, str]]:
            return {key for key, containers in view.items()
                    if key not in self._known and key not in self._given_up
                    and not any(ids for by in containers.values() for ids in by.values())}

        with self._lock:
            self._given_up &= set(view)  # gone from the node: no longer worth remembering
            if not missing():
                return
            self._delivered.wait_for(lambda: not missing(), timeout=self.watch_lag_wait_s)
            late = missing()
            self._given_up |= late
        if late:
            self._log.info("plugin.plans.pod_not_delivered", pods=sorted(f"{ns}/{n}" for ns, n in late)[:5],
                           waited_s=self.watch_lag_wait_s)

    def _read_kubelet_view(self) -> KubeletView | None:
        """The kubelet's PodResources List, or None when there is none to read or it failed (said once per
        outage); the kubelet's admission order then stands alone."""
        if self._kubelet_view is None:
            return None
        try:
            view = self._kubelet_view()
        except Exception as e:  # the kubelet's rate limit, a restart, a slow answer
            if not self._view_failed:
                self._view_failed = True
                self._log.warning("plugin.plans.kubelet_view_failed", error=str(e)[:300])
            self._metrics.kubelet_view_failures.inc()
            return None
        if self._view_failed:
            self._view_failed = False
            self._log.info("plugin.plans.kubelet_view_back")
        return view

    def _mark_held(self, pending_now: Sequence[PendingPlan], resource: str, view: KubeletView) -> None:
        """What the List tells of the pending pods: a container listed with devices of `resource` is done (the pod
        may stay Pending for minutes of image pulls, and a restarted plugin has no memory of what it handed)."""
        with self._lock:
            for pending in pending_now:
                containers = view.get((pending.namespace, pending.name)) or {}
                held = {c for c, by_resource in containers.items() if by_resource.get(resource)}
                if held and pending.uid in self._pending:
                    self._handed.setdefault(pending.uid, set()).update(held)

    def _fitting(
        self, pending_now: Sequence[PendingPlan], available: set[str], must: set[str], size: int
    ) -> tuple[int, list[tuple[PendingPlan, str, tuple[str, ...]]]]:
        """Each pod's next container not yet handed out, where its plan answers this request; and the furthest a
        plan got (the reported miss reason)."""
        furthest = 1 if pending_now else 0
        fits = []
        with self._lock:
            handed = {uid: set(cs) for uid, cs in self._handed.items()}
        for pending in pending_now:
            done = handed.get(pending.uid, set())
            nxt = next(((c, ids) for c, ids in pending.plan.containers if c not in done), None)
            if nxt is None:
                continue
            container, ids = nxt
            if len(ids) != size:
                continue
            furthest = max(furthest, 2)
            if not available.issuperset(ids):
                continue
            if not must.issubset(ids):
                furthest = 3
                continue
            fits.append((pending, container, ids))
        return furthest, fits

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
        try:
            self._process(event_type, obj)
        finally:
            self._follow_known(event_type, obj)

    def _follow_known(self, event_type: str, obj: dict[str, Any]) -> None:
        """The pods delivered so far, by name (what PodResources names them by), for `_caught_up`."""
        def key(pod: Any) -> tuple[str, str] | None:
            meta = _meta(pod) if isinstance(pod, dict) else {}
            name = meta.get("name")
            return (str(meta.get("namespace") or "default"), name) if isinstance(name, str) else None

        with self._lock:
            if event_type == SYNC:
                self._known = {k for pod in obj.get("items") or [] if (k := key(pod)) is not None}
            elif (k := key(obj)) is not None:
                if event_type == "DELETED":
                    self._known.discard(k)
                else:
                    self._known.add(k)
                    self._given_up.discard(k)
            self._delivered.notify_all()

    def _process(self, event_type: str, obj: dict[str, Any]) -> None:
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
                        self._handed.pop(uid, None)
                self._ignored = {u: w for u, w in self._ignored.items() if u in seen}
        elif event_type == "DELETED":
            uid = _meta(obj).get("uid")
            with self._lock:
                self._pending.pop(uid, None)
                self._handed.pop(uid, None)
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
                self._handed.pop(uid, None)
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
            if old is not None:
                self._handed.pop(uid, None)  # a new plan for the pod: none of it has been handed out
            self._seq += 1
            created = meta.get("creationTimestamp")
            self._pending[uid] = PendingPlan(
                uid, str(meta.get("namespace", "")), str(meta.get("name", "")), old.seq if old else self._seq,
                _in_kubelet_order(plan, pod), created if isinstance(created, str) else "",
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


def _in_kubelet_order(plan: Plan, pod: Mapping[str, Any]) -> Plan:
    """The plan with its containers in the order the kubelet allocates them: init containers, then the others, as
    the pod spec lists them (a container the spec does not name goes last; the kubelet will never ask for it)."""
    spec = pod.get("spec") if isinstance(pod.get("spec"), dict) else {}
    order: list[str] = []
    for field in ("initContainers", "containers"):
        for c in spec.get(field) or []:
            if isinstance(c, dict) and isinstance(c.get("name"), str):
                order.append(c["name"])
    rank = {name: i for i, name in enumerate(order)}
    containers = tuple(sorted(plan.containers, key=lambda c: rank.get(c[0], len(rank))))
    return plan if containers == plan.containers else replace(plan, containers=containers)


class _ResourcePlans:
    """PlanWatch's plans of one shared resource, as a PlanSource."""

    def __init__(self, watch: PlanWatch, resource: str) -> None:
        self._watch = watch
        self.resource = resource

    def pending_plan(
        self, available_ids: Sequence[str], must_include_ids: Sequence[str], size: int
    ) -> list[str] | None:
        return self._watch._plan_for(self.resource, available_ids, must_include_ids, size)
