"""kube-scheduler's four verbs over one Extender: decoded JSON in, the answer out as plain data.

A pod of a job (extender.membership.job) is filtered and prioritized by its job's plan (extender.jobs.plans),
every other pod by extender.placement.engine. Nothing here knows about HTTP: extender.http.answers reads and
bounds the body, decodes it, calls a verb and maps every failure to an answer; extender.http.routers.scheduler
publishes the verbs. The answer shapes are the Go structs of k8s.io/kube-scheduler/extender/v1
(ExtenderFilterResult, HostPriorityList, ExtenderBindingResult, ExtenderPreemptionResult), field for field.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import anyio
import structlog

from extender import wire
from extender.dra_verbs import DraVerbs
from extender.jobs.plans import JobPod
from extender.placement.engine import FilterOutcome
from extender.preempt import NodeVictims, keep_victims
from extender.service import Extender
from extender.state.pods import PodNeeds, PodSpecError, nominated_node
from gputopo.kube import KubeApiError, KubeArgumentError

log = structlog.get_logger(__name__)


def filter_result(passed: list[str] | None, nodes: dict[str, Any] | None, failed: dict[str, str],
                  unresolvable: dict[str, str], error: str) -> dict[str, Any]:
    return {"Nodes": nodes, "NodeNames": passed, "FailedNodes": failed,
            "FailedAndUnresolvableNodes": unresolvable, "Error": error}


def meta_victims(candidates: dict[str, NodeVictims]) -> dict[str, Any]:
    return {node: {"Pods": [{"UID": v.uid} for v in nv.victims], "NumPDBViolations": nv.pdb_violations}
            for node, nv in candidates.items()}


def host_priority_list(names: list[str], scores: list[int]) -> list[dict[str, Any]]:
    """kube-scheduler's HostPriorityList: one {"Host", "Score"} per node, in the request's order."""
    return [{"Host": name, "Score": score} for name, score in zip(names, scores, strict=True)]


class Verbs:
    """The four verbs; each raises wire.BadRequest for a body that is not the shape kube-scheduler sends, and
    answers a pod it cannot place in the body, as kube-scheduler expects."""

    def __init__(self, ext: Extender, *, plan_in_thread: bool = True) -> None:
        """plan_in_thread=False: a job pod's filter answers synchronously too (callers without an event loop)."""
        self.ext = ext
        cfg = ext.config
        self._best_only = cfg.filter_best
        self._plan_in_thread = plan_in_thread
        self._planners = anyio.CapacityLimiter(1)  # plans are made one at a time anyway: hold no more threads
        self._dra = DraVerbs(ext, self._scores, filter_best=cfg.filter_best)  # pods served by our DRA driver

    def filter(self, data: Any) -> dict[str, Any] | Awaitable[dict[str, Any]]:
        """The answer, or for a pod of a job an awaitable of it: planning a job may take tens of milliseconds on a
        large cluster, so it runs in a worker thread (one job plan at a time: extender.jobs.plans' lock) while the
        event loop keeps answering binds, probes and other pods."""
        args = wire.extender_args(data)
        extra = self._extra_entries(args)
        ext = self.ext
        try:
            needs = ext.cache.needs.of(args.pod, self._shared_names(extra))  # read once per pod (by UID)
        except PodSpecError as e:
            return filter_result(None if args.node_names is None else [], None if args.nodes is None else
                                 {**args.nodes, "items": []}, {}, {}, f"pod cannot be placed: {e}")
        ext.recent.remember(needs)
        job_pod = ext.jobs.pod_of(args.pod, needs) if needs.need.resource is None else None
        dra = self._dra.ask(args, needs) if job_pod is None else None
        if dra is not None:
            return self._filter_answer(args, self._dra.filter(args.names, needs, extra, *dra))
        if job_pod is not None:
            if not self._plan_in_thread:
                out = self._best(needs, extra, job_pod, ext.jobs.filter(job_pod, args.names))
                return self._filter_answer(args, out)
            return self._job_filter(args, needs, job_pod)
        out = self._best(needs, extra, None, ext.placement.filter(args.names, needs.need, extra))
        nominated = nominated_node(args.pod)
        if nominated is not None and nominated in out.failed and getattr(ext, "sync", None) is not None:
            if not self._plan_in_thread:
                return self._filter_answer(args, self._confirmed(args, needs, extra, nominated, out))
            return self._filter_confirmed(args, needs, extra, nominated, out)
        return self._filter_answer(args, out)

    def _confirmed(self, args: wire.ExtenderArgs, needs: PodNeeds, extra: dict[str, Any] | None, node: str,
                   out: FilterOutcome) -> FilterOutcome:
        """The pod's nominated node refused: kube-scheduler preempted victims there and retries the moment it sees
        them go, which the pod watch here may not have delivered yet. Refused on a stale view, it would preempt a
        second node. So the node's pods are read from the apiserver, those gone are dropped, and the filter is
        answered again (extender.state.cache: a pod being deleted that still runs keeps its GPUs)."""
        assert self.ext.sync is not None
        try:
            dropped = self.ext.sync.confirm_node(node)
        except (KubeApiError, KubeArgumentError) as e:
            log.warning("extender.filter.confirm_failed", node=node, error=str(e))
            return out
        return self._best(needs, extra, None, self.ext.placement.filter(args.names, needs.need, extra)) \
            if dropped else out

    async def _filter_confirmed(self, args: wire.ExtenderArgs, needs: PodNeeds, extra: dict[str, Any] | None,
                                node: str, out: FilterOutcome) -> dict[str, Any]:
        out = await anyio.to_thread.run_sync(self._confirmed, args, needs, extra, node, out)
        return self._filter_answer(args, out)

    async def _job_filter(self, args: wire.ExtenderArgs, needs: PodNeeds, job_pod: JobPod) -> dict[str, Any]:
        out = await anyio.to_thread.run_sync(self.ext.jobs.filter, job_pod, args.names, limiter=self._planners)
        return self._filter_answer(args, self._best(needs, None, job_pod, out))

    def _best(self, needs: PodNeeds, extra: dict[str, Any] | None, job_pod: JobPod | None,
              out: FilterOutcome) -> FilterOutcome:
        """With --filter-best, only the passed nodes of the best score, as prioritize would score them (which
        is not asked then). The others are left out of the answer, not failed: they are fine, just not the best,
        and kube-scheduler only lists failures when no node is left."""
        if not self._best_only or len(out.passed) < 2:
            return out
        scores = self._scores(out.passed, needs, extra, job_pod)
        top = max(scores)
        return FilterOutcome([n for n, s in zip(out.passed, scores, strict=True) if s == top], out.failed,
                             out.unresolvable)

    def _filter_answer(self, args: wire.ExtenderArgs, out: FilterOutcome) -> dict[str, Any]:
        requeue = self.ext.requeue
        if requeue is not None and not out.passed and (out.failed or out.unresolvable):
            meta = args.pod.get("metadata") or {}
            requeue.refused(str(meta.get("uid") or ""), str(meta.get("namespace") or "default"),
                            str(meta.get("name") or ""))
        m = self.ext.metrics.filter_nodes
        m.labels("passed").inc(len(out.passed))
        m.labels("failed").inc(len(out.failed))
        m.labels("unresolvable").inc(len(out.unresolvable))
        nodes = None
        if args.nodes is not None and args.items is not None:
            keep = set(out.passed)
            nodes = {**args.nodes, "items": [it for it in args.items if it["metadata"]["name"] in keep]}
        if args.node_names is not None:
            wire.known_valid(out.passed, written=True)  # prioritize's NodeNames, next
        return filter_result(out.passed if args.node_names is not None else None, nodes, out.failed,
                             out.unresolvable, "")

    def prioritize(self, data: Any) -> list[dict[str, Any]]:
        args = wire.extender_args(data)
        extra = self._extra_entries(args)
        try:
            needs = self.ext.cache.needs.of(args.pod, self._shared_names(extra))
        except PodSpecError as e:
            log.info("extender.prioritize.bad_pod", error=str(e))
            return host_priority_list(args.names, [0] * len(args.names))
        self.ext.recent.remember(needs)
        job_pod = self.ext.jobs.pod_of(args.pod, needs) if needs.need.resource is None else None
        dra = self._dra.ask(args, needs) if job_pod is None else None
        if dra is not None:
            return host_priority_list(args.names, self._dra.scores(args.names, needs, extra, *dra))
        return host_priority_list(args.names, self._scores(args.names, needs, extra, job_pod))

    def _scores(self, names: list[str], needs: PodNeeds, extra: dict[str, Any] | None,
                job_pod: JobPod | None) -> list[int]:
        """prioritize's scores of `names`, as filter --filter-best ranks them too: a job pod's by its job's plan,
        else the placement's, whose best offer bind's explanation compares the chosen node with."""
        scores = self.ext.jobs.score(job_pod, names) if job_pod is not None else None
        if scores is None:
            scores, offer = self.ext.placement.score_offer(names, needs.need, extra)
            self.ext.explainer.remember(needs.uid, offer)
        return scores

    async def bind(self, data: Any) -> dict[str, Any]:
        req = wire.binding_args(data)
        if self.ext.requeue is not None:
            self.ext.requeue.placed(req.uid)
        return {"Error": await self.ext.binder.bind(req, planned=not self._dra.serves(req.node))}

    def preempt(self, data: Any) -> dict[str, Any]:
        args = wire.preemption_args(data, self.ext.config.keys.plan)
        try:
            needs = self.ext.cache.needs.of(args.pod, self.ext.cache.shared_names)
        except PodSpecError as e:
            log.info("extender.preempt.bad_pod", error=str(e))
            return {"NodeNameToMetaVictims": meta_victims(args.candidates)}
        placement = self.ext.placement
        if placement.shared_resource(needs.need) is not None or placement.mig_resource(needs.need) is not None:
            # victims of replicas or MIG instances: kube-scheduler's own
            return {"NodeNameToMetaVictims": meta_victims(args.candidates)}
        kept = keep_victims(self.ext.cache, self.ext.placement, needs.need, args.candidates, self.ext.plan_of)
        return {"NodeNameToMetaVictims": meta_victims(kept)}

    def _shared_names(self, extra: dict[str, Any] | None) -> frozenset[str]:
        """The resource names shared as replicas by the cache's nodes, and by the request's own unseen nodes."""
        names = self.ext.cache.shared_names
        if extra:
            listed = [e.sharing.names for e in extra.values() if e.sharing is not None]
            if listed:
                names = names.union(*listed)
        return names

    def _extra_entries(self, args: wire.ExtenderArgs) -> dict[str, Any] | None:
        """Not nodeCacheCapable: nodes the cache has not seen yet are read from the NodeList itself."""
        if args.items is None:
            return None
        known = self.ext.cache.nodes
        extra = {}
        for item in args.items:
            name = item["metadata"]["name"]
            if name not in known:
                extra[name] = self.ext.cache.entry_from_node(item)
        return extra or None
