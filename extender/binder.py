"""The bind verb: choose the GPUs on the chosen node, reserve them, and POST the Binding with the plan.

Choose+reserve runs under the node's lock and is synchronous (no await inside), so two binds to one node never see
the same free GPUs; the apiserver's POST and reads of a pod run outside any lock, in worker threads (at most
`api_concurrency` at once). A separate posting process was measured not to pay for itself behind the real
kube-scheduler, and a signal to the process group killed it mid-bind. If the call
fails the reservation is released and kube-scheduler gets the Error (it retries the pod later), except when the
apiserver may still apply the Binding (no answer after the request went out, or 504): the GPUs then stay reserved
until the pod is seen bound or gone, or the reservation times out, so they are never planned for a second pod
meanwhile. A bind retried for a pod that is already bound to that node answers success: the first attempt's plan
stands.

Standalone mode (no apiserver) commits the plan into the inventory under the same lock instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import kubernetes.client
import structlog

from extender.config import ExtenderConfig
from extender.metrics import ExtenderMetrics
from extender.placement.engine import NoFit, Placement
from extender.placement.explain import Explainer
from extender.placement.mig import explain_plan, is_mig_plan, mig_plan
from extender.placement.shared import SharedChoice, explain_shared
from extender.state.cache import NodeCache, NodeEntry, PodRecord
from extender.state.inventory import Inventory
from extender.state.pods import Need, PodNeeds, PodSpecError, RecentPods, split_plan
from extender.state.reservations import BIND, Reservation
from extender.state.sharing import thresholds
from gputopo.contract import Plan, encode_plan
from gputopo.core import Topology
from gputopo.core.bitset import mask_of
from gputopo.kube import ApiUnavailable, Conflict, KubeApiError, KubeArgumentError, NotFound, bind_pod, get_pod
from gputopo.kube import may_have_applied as maybe_applied

if TYPE_CHECKING:
    from extender.jobs.plans import JobPlans

log = structlog.get_logger(__name__)

ALREADY_BOUND = "already_bound"
BOUND = "bound"


@dataclass(frozen=True)
class BindRequest:
    name: str
    namespace: str
    uid: str
    node: str

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def holder(self) -> str:
        """Who a reservation is held for: the pod's UID (kube-scheduler always sends it), else its name."""
        return self.uid or f"name:{self.key}"


class BindFailed(Exception):
    """A bind that cannot be done; `outcome` is the metrics label, the message goes into the Error field."""

    def __init__(self, outcome: str, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.message = message


def planned(node: str, topo: Topology, gpus: Sequence[int], needs: PodNeeds, resource: str, gbps: float) -> Plan:
    """The plan of these GPUs (topology indices) split over the pod's containers, in the pod's container order."""
    parts = split_plan(topo, gpus, needs.containers)
    order = [c.name for c in needs.containers if c.name in parts]
    return Plan(node=node, resource=resource, gbps=gbps,
                containers=tuple((name, tuple(topo.gpus[i].id for i in parts[name])) for name in order))


class Binder:
    def __init__(
        self,
        config: ExtenderConfig,
        cache: NodeCache,
        placement: Placement,
        metrics: ExtenderMetrics,
        recent: RecentPods,
        *,
        api: kubernetes.client.ApiClient | None = None,
        inventory: Inventory | None = None,
        api_concurrency: int = 8,
        explainer: Explainer | None = None,
        jobs: JobPlans | None = None,
    ) -> None:
        if (api is None) == (inventory is None):
            raise ValueError("a binder needs exactly one of an apiserver client or an inventory")
        self.config = config
        self.cache = cache
        self.placement = placement
        self.metrics = metrics
        self.recent = recent
        self.api = api
        self.inventory = inventory
        self.jobs = jobs  # a job's pod takes its slot of the job's plan (extender.jobs.plans)
        self._api_limiter = anyio.CapacityLimiter(api_concurrency)
        self.explainer = explainer
        # Leader election (extender.leadership): a bind is written only while this replica may act, and a replica
        # that steps down waits for the binds it started before it lets another lead.
        self.may_bind: Callable[[], bool] = lambda: True
        self._in_flight = 0
        self._idle = threading.Condition()

    def wait_idle(self, timeout: float) -> bool:
        """True once no bind is in flight (any thread), False after `timeout` seconds with some still out."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout)

    async def bind(self, req: BindRequest, *, planned: bool = True) -> str:
        """Bind the pod; returns "" on success or the Error text for kube-scheduler. planned=False: a node whose
        GPUs kube-scheduler's DRA plugin already allocated (extender.dra_verbs): the Binding carries no plan."""
        started = time.perf_counter()
        with self._idle:
            self._in_flight += 1
        try:
            outcome = await (self._bind(req) if planned else self._bind_unplanned(req))
        except BindFailed as e:
            self.metrics.binds.labels(e.outcome).inc()
            log.info("extender.bind.failed", pod=req.key, node=req.node, outcome=e.outcome, error=e.message)
            return e.message
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()
        self.metrics.binds.labels(outcome).inc()
        log.debug("extender.bind.done", pod=req.key, node=req.node, outcome=outcome,
                  ms=round((time.perf_counter() - started) * 1000, 2))
        return ""

    # -- steps ------------------------------------------------------------------------------------------------

    async def _bind_unplanned(self, req: BindRequest) -> str:
        if self.inventory is not None:
            return BOUND
        if not self.may_bind():
            raise BindFailed("standby", f"pod {req.key} not bound: this gpu-extender replica no longer holds the "
                                        "leader election Lease")
        return await self._post_binding(req, None, None)

    async def _bind(self, req: BindRequest) -> str:
        needs = await self._needs(req)
        if isinstance(needs, str):
            return needs  # already bound there
        plan, res = self._reserve(req, needs)
        if self.inventory is not None:
            return BOUND
        if not self.may_bind():  # the Lease lost or released since the request came in: another may lead
            self._release(req, res)
            raise BindFailed("standby", f"pod {req.key} not bound: this gpu-extender replica no longer holds the "
                                        "leader election Lease")
        outcome = await self._post_binding(req, plan, res)
        if res is not None:  # bound: from now on the reservation ends by state or by the pod going away
            self.cache.reservations.mark_bound(req.holder, req.node, res)
        return outcome

    async def _needs(self, req: BindRequest) -> PodNeeds | str:
        rec = self.cache.pods.get(req.uid) if req.uid else None
        if rec is not None and rec.node is not None:
            return self._already_bound(req, rec)
        needs = rec.needs if rec is not None else None
        if needs is None and req.uid:
            needs = self.recent.get(req.uid)
        if needs is not None:
            return needs
        if self.api is None:
            raise BindFailed("unknown_pod", f"pod {req.key} (uid {req.uid or 'none'}) was never seen by /filter or "
                             "/prioritize: standalone mode learns pods from their bodies")
        try:
            pod = await self._api_call(get_pod, self.api, req.namespace, req.name)
        except NotFound:
            raise BindFailed("not_found", f"pod {req.key} not found") from None
        except (KubeApiError, KubeArgumentError) as e:
            raise BindFailed("api_error", f"cannot read pod {req.key}: {e}") from None
        uid = (pod.get("metadata") or {}).get("uid")
        if req.uid and uid != req.uid:
            raise BindFailed("conflict", f"pod {req.key} has uid {uid}, not {req.uid}: it was recreated")
        fetched = self.cache.record_from_pod(pod)
        if fetched is not None and fetched.node is not None:
            return self._already_bound(req, fetched)
        try:
            return self.cache.needs.of(pod, self.cache.shared_names)
        except PodSpecError as e:
            raise BindFailed("bad_pod", f"pod {req.key}: {e}") from None

    def _already_bound(self, req: BindRequest, rec: PodRecord) -> str:
        if rec.node == req.node:
            if rec.plan is None and rec.needs is not None and rec.needs.size > 0:
                log.warning("extender.bind.bound_without_plan", pod=req.key, node=req.node)
            return ALREADY_BOUND
        raise BindFailed("conflict", f"pod {req.key} is already bound to node {rec.node}, not {req.node}")

    def _reserve(self, req: BindRequest, needs: PodNeeds) -> tuple[Plan | None, Reservation | None]:
        """Choose and reserve atomically under the node lock; no await in here."""
        with self.cache.lock_for(req.node):
            existing = self.cache.reservations.get(req.holder, req.node)
            if existing is not None and existing.plan is not None:
                return existing.plan, existing  # a retry: the plan made by the first attempt stands
            if needs.size == 0:
                if self.inventory is not None:
                    self.inventory.commit(None, PodRecord(req.uid, req.namespace, req.name, req.node, "Running",
                                                          False, needs, None, None))
                return None, None
            entry = self.cache.nodes.get(req.node)
            resource = needs.need.resource or self.config.resource_name
            mig = self.placement.mig_resource(needs.need)
            if mig is not None and (needs.need.resource is not None or (entry is not None and entry.serves_mig(mig))):
                return self._reserve_mig(req, needs, entry, mig)
            if needs.need.resource is not None or (entry is not None and entry.shares(resource)):
                return self._reserve_shared(req, needs, entry, resource)
            free = self.cache.free_mask(entry) if entry is not None else 0
            claim = self.jobs.slot_for(req.holder, req.node, needs.size) if self.jobs is not None else None
            try:
                alloc = claim.alloc if claim is not None else self.placement.choose(entry, free, needs.need)
            except NoFit as e:
                raise BindFailed("no_fit", f"node {req.node} cannot take pod {req.key}: {e.reason}") from None
            assert entry is not None and entry.topo is not None
            topo = entry.topo
            plan = planned(req.node, topo, alloc.gpus, needs, self.config.resource_name, alloc.allreduce_gbps)
            self.metrics.plan_efficiency.observe(self.placement.efficiency(topo, alloc))
            self.metrics.plan_bandwidth.observe(alloc.allreduce_gbps * 1e9)
            if self.inventory is not None:
                self.inventory.commit(entry, PodRecord(req.uid, req.namespace, req.name, req.node, "Running", False,
                                                       needs, plan, encode_plan(plan)))
                if self.jobs is not None:
                    self.jobs.bound(req.holder, req.node, alloc.gpus, claim)
                log.info("extender.bind.planned", pod=req.key, node=req.node, plan=plan.container_ids(),
                         gbps=plan.gbps)
                return plan, None
            res = self.cache.reservations.add(req.holder, req.namespace, req.name, req.node, plan.ids,
                                              mask_of(alloc.gpus), BIND, plan)
            if self.jobs is not None:
                self.jobs.bound(req.holder, req.node, alloc.gpus, claim)
        log.info("extender.bind.planned", pod=req.key, node=req.node, plan=plan.container_ids(), gbps=plan.gbps)
        return plan, res

    def _reserve_shared(self, req: BindRequest, needs: PodNeeds, entry: NodeEntry | None, resource: str
                        ) -> tuple[Plan, Reservation | None]:
        """Replicas of k distinct shared GPUs (extender.placement.shared): the plan names the parent GPUs, and the
        reservation holds one replica on each until the node's state counts it. The caller holds the node lock."""
        try:
            choice = self.placement.choose_shared(entry, resource, needs.size, needs.need.largest_request)
        except NoFit as e:
            raise BindFailed("no_fit", f"node {req.node} cannot take pod {req.key}: {e.reason}") from None
        assert entry is not None and entry.topo is not None
        plan = planned(req.node, entry.topo, choice.gpus, needs, resource, choice.gbps)
        if self.inventory is not None:
            self.inventory.commit(entry, PodRecord(req.uid, req.namespace, req.name, req.node, "Running", False,
                                                   needs, plan, encode_plan(plan)))
            log.info("extender.bind.planned", pod=req.key, node=req.node, plan=plan.container_ids(), shared=resource)
            return plan, None
        assert entry.sharing is not None
        replicas = thresholds(plan.ids, entry.sharing.used_by_id(), self.cache.reservations.pending_replicas(req.node))
        res = self.cache.reservations.add(req.holder, req.namespace, req.name, req.node, plan.ids, 0, BIND, plan,
                                          replicas)
        log.info("extender.bind.planned", pod=req.key, node=req.node, plan=plan.container_ids(), shared=resource)
        return plan, res

    def _reserve_mig(self, req: BindRequest, needs: PodNeeds, entry: NodeEntry | None, resource: str
                     ) -> tuple[Plan, Reservation | None]:
        """MIG instances (extender.placement.mig): the plan names MIG UUIDs, the reservation holds them until the
        node's state shows them held. The caller holds the node lock."""
        try:
            choice = self.placement.choose_mig(entry, resource, needs.need)
        except NoFit as e:
            raise BindFailed("no_fit", f"node {req.node} cannot take pod {req.key}: {e.reason}") from None
        plan = mig_plan(req.node, choice, needs.containers)
        res = None
        if self.inventory is not None:
            self.inventory.commit(entry, PodRecord(req.uid, req.namespace, req.name, req.node, "Running", False,
                                                   needs, plan, encode_plan(plan)))
        else:
            res = self.cache.reservations.add(req.holder, req.namespace, req.name, req.node, plan.ids, 0, BIND, plan,
                                              instances=True)
        log.info("extender.bind.planned", pod=req.key, node=req.node, plan=plan.container_ids(), mig=resource)
        return plan, res

    def _annotations(self, req: BindRequest, plan: Plan | None) -> dict[str, str]:
        if plan is None:  # a pod asking no GPU; one of a job's (a TFJob's parameter server) says where it went
            text = None
            try:
                text = self.jobs.describe_companion(req.holder, req.node) if self.jobs is not None else None
            except Exception as e:  # never in the way of the bind
                log.warning("extender.bind.unexplained", pod=req.key, error=f"{type(e).__name__}: {e}")
            return {self.config.keys.placement: text} if text else {}
        out = {self.config.keys.plan: encode_plan(plan), self.config.keys.gbps: f"{plan.gbps:.1f}"}
        placement = self._placement(req, plan)
        if placement:
            out[self.config.keys.placement] = placement
        return out

    def _placement(self, req: BindRequest, plan: Plan) -> str | None:
        """The plan's explanation (extender.placement.explain); never in the way of the bind."""
        entry = self.cache.nodes.get(plan.node)
        if self.explainer is not None and entry is not None and is_mig_plan(entry, plan):
            return explain_plan(entry, plan, self.cache.reservations.pending_instances(entry.name))
        if self.explainer is None or entry is None or entry.topo is None:
            return None
        if entry.shares(plan.resource):
            return self._placement_shared(entry, plan)
        try:
            gpus = sorted(entry.topo.indices_of(plan.ids))
            known = self.recent.get(req.uid)
            need = known.need if known is not None else Need(len(gpus))
            job = self.jobs.describe(req.holder) if self.jobs is not None else None
            return self.explainer.explain(req.uid, plan.node, entry.topo, gpus, plan.gbps, need, job=job)
        except Exception as e:
            log.warning("extender.bind.unexplained", pod=req.key, error=f"{type(e).__name__}: {e}")
            return None

    def _placement_shared(self, entry: NodeEntry, plan: Plan) -> str | None:
        """The shared plan's words, from the counts now: they include this pod's own replica (reserved or shown)."""
        assert entry.topo is not None and entry.sharing is not None
        view = entry.sharing.resource(plan.resource)
        if view is None:
            return None
        pending = self.cache.reservations.pending_replicas(entry.name)
        gpus = sorted(entry.topo.indices_of(plan.ids))
        ids = entry.topo.ids
        counts = {g: (u + pending.get(ids[g], 0), rep) for g, rep, u in zip(view.gpus, view.replicas, view.used,
                                                                             strict=True)}
        before = tuple(max(0, counts[g][0] - 1) if g in counts else 0 for g in gpus)
        replicas = tuple(counts[g][1] if g in counts else 0 for g in gpus)
        effective = plan.gbps / (1 + max(before, default=0))
        return explain_shared(plan.node, SharedChoice(plan.resource, entry.sharing.strategy, tuple(gpus), plan.gbps,
                                                      effective, before, replicas, ()))

    async def _api_call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs), limiter=self._api_limiter)

    def _release(self, req: BindRequest, res: Reservation | None) -> None:
        if res is not None:
            self.cache.reservations.release_if(req.holder, req.node, res)

    def _post_if_leading(self, req: BindRequest, annotations: dict[str, str]) -> None:
        """The POST, in a worker thread; the Lease is checked again once the thread has room, so a bind that waited
        for one while this replica stepped down is never written (ApiUnavailable, not sent: the caller releases)."""
        if not self.may_bind():
            err = ApiUnavailable(0, "NotLeading", "this gpu-extender replica no longer holds the leader election "
                                 "Lease", operation=f"bind pod {req.key} to {req.node}")
            err.applied = False
            raise err
        assert self.api is not None
        bind_pod(self.api, namespace=req.namespace, name=req.name, uid=req.uid or None, node=req.node,
                 annotations=annotations)

    async def _post_binding(self, req: BindRequest, plan: Plan | None, res: Reservation | None) -> str:
        try:
            await self._api_call(self._post_if_leading, req, self._annotations(req, plan))
        except Conflict as e:
            return await self._resolve_conflict(req, plan, res, e)
        except NotFound:
            self._release(req, res)
            raise BindFailed("not_found", f"pod {req.key} not found: it was deleted") from None
        except KubeApiError as e:
            if res is not None and maybe_applied(e):
                log.warning("extender.bind.outcome_unknown", pod=req.key, node=req.node, gpus=sorted(res.ids),
                            error=str(e))
                raise BindFailed("outcome_unknown", f"binding pod {req.key} to {req.node} failed: {e}; the "
                                 "apiserver may still apply it, so its GPUs stay reserved until the pod is seen "
                                 "bound or gone, or the reservation times out") from None
            self._release(req, res)
            raise BindFailed("api_error", f"binding pod {req.key} to {req.node} failed: {e}") from None
        except KubeArgumentError as e:
            self._release(req, res)
            raise BindFailed("api_error", f"binding pod {req.key} to {req.node} failed: {e}") from None
        except BaseException:
            self._release(req, res)
            raise
        return BOUND

    async def _resolve_conflict(self, req: BindRequest, plan: Plan | None, res: Reservation | None,
                                err: Conflict) -> str:
        """409: success only if the pod already sits on this node (an earlier attempt of the same bind won)."""
        try:
            pod = await self._api_call(get_pod, self.api, req.namespace, req.name)
        except (KubeApiError, KubeArgumentError) as e:
            self._release(req, res)
            raise BindFailed("conflict", f"binding pod {req.key} to {req.node} conflicted ({err.message}); "
                             f"reading it back failed: {e}") from None
        node_now = (pod.get("spec") or {}).get("nodeName")
        if node_now == req.node:
            rec = self.cache.record_from_pod(pod)
            if rec is None or rec.plan is None or plan is None or rec.plan.ids != plan.ids:
                self._release(req, res)
                if rec is not None:
                    self.cache.update_pod(pod)  # reserves the plan it actually carries, if any
            log.info("extender.bind.already_bound", pod=req.key, node=req.node)
            return ALREADY_BOUND
        self._release(req, res)
        where = f"it is bound to {node_now}" if node_now else "it is not bound"
        raise BindFailed("conflict", f"binding pod {req.key} to {req.node} conflicted: {err.message} ({where})")
