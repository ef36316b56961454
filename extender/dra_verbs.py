"""filter and prioritize for pods our DRA driver serves: the best DRA node as well as the best set.

kube-scheduler's DRA allocator hands out the first free device in the published order, which our driver keeps best
first inside each node; across nodes it scores only the index of a claim's `firstAvailable` tier, so among nodes
where the same tier fits the choice was arbitrary, and plain `nvidia.com/gpu: N` requests served through the
DeviceClass's extendedResourceName have no tiers at all. This ranks the DRA nodes by what the allocator would hand
out there (extender.placement.dra, from the slices and claims extender.state.slices watches).

Which pods come here: a pod whose claims ask GPUs of our driver (the claim templates), or that asks the configured
resource while some of the request's nodes are DRA nodes. filter passes the DRA nodes (kube-scheduler's DRA plugin
has already filtered them) and, with --filter-best, keeps the best; prioritize scores them. The request's other
nodes take the device-plugin path. Every other pod never gets here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from extender import wire
from extender.jobs.plans import JobPod
from extender.placement.dra import DraAsk, claims_ask, plain_ask, rank
from extender.placement.engine import FilterOutcome
from extender.service import Extender
from extender.state.pods import PodNeeds
from extender.state.slices import DraView

Scores = Callable[[list[str], PodNeeds, dict[str, Any] | None, JobPod | None], list[int]]


class DraVerbs:
    def __init__(self, ext: Extender, scores: Scores, *, filter_best: bool) -> None:
        """`scores`: the device-plugin path's prioritize scores, for the request's other nodes."""
        self.ext = ext
        self._scores = scores
        self._best_only = filter_best

    def _view(self) -> DraView | None:
        dra = getattr(self.ext, "dra", None)
        return dra if isinstance(dra, DraView) and not dra.empty else None

    def ask(self, args: wire.ExtenderArgs, needs: PodNeeds) -> tuple[DraAsk, list[str]] | None:
        """(the pod's GPU ask, the request's DRA nodes), or None: the device-plugin paths."""
        dra = self._view()
        if dra is None:
            return None
        pod = args.pod if isinstance(args.pod, dict) else {}
        if (pod.get("spec") or {}).get("resourceClaims"):
            ask = self._claims_ask(dra, pod)
            if ask is not None:
                return ask, [n for n in args.names if dra.serves(n)]
        if needs.size > 0 and needs.need.resource is None and not needs.need.constrained:
            names = [n for n in args.names if self.serves(n)]
            if names:
                return plain_ask(needs.size), names
        return None

    def _claims_ask(self, dra: DraView, pod: dict[str, Any]) -> DraAsk | None:
        """The GPU ask of the pod's claims (kube-controller-manager has made them from their templates before
        kube-scheduler tries the pod); None when a claim is not known yet (not read here: no RBAC for get), already
        allocated, or asks nothing ours."""
        namespace = str((pod.get("metadata") or {}).get("namespace") or "default")
        made = {s.get("name"): s.get("resourceClaimName")
                for s in (pod.get("status") or {}).get("resourceClaimStatuses") or [] if isinstance(s, dict)}
        requests: list[Any] = []
        for ref in (pod.get("spec") or {}).get("resourceClaims") or []:
            if not isinstance(ref, dict):
                continue
            name = ref.get("resourceClaimName") or made.get(ref.get("name"))
            if not isinstance(name, str) or not name:
                return None
            info = dra.claim(namespace, name)  # the watch: kube-scheduler waits for the claim in its own
            if info is None or info.is_allocated:
                return None
            requests += info.requests
        return claims_ask(requests, dra.driver)

    def serves(self, node: str) -> bool:
        """A node of our DRA driver that the device plugin does not serve (no topology in the node cache)."""
        dra = self._view()
        if dra is None or not dra.serves(node):
            return False
        entry = self.ext.cache.nodes.get(node)
        return entry is None or entry.topo is None

    def filter(self, names: list[str], needs: PodNeeds, extra: dict[str, Any] | None, ask: DraAsk,
               dra_names: list[str]) -> FilterOutcome:
        own = set(dra_names)
        others = [n for n in names if n not in own]
        out = FilterOutcome(others, {}, {})
        if others and needs.size > 0:
            out = self.ext.placement.filter(others, needs.need, extra)
        passed = own.union(out.passed)
        out = FilterOutcome([n for n in names if n in passed], dict(out.failed), dict(out.unresolvable))
        if not self._best_only or len(out.passed) < 2:
            return out
        scores = self.scores(out.passed, needs, extra, ask, dra_names)
        top = max(scores)
        return FilterOutcome([n for n, s in zip(out.passed, scores, strict=True) if s == top], out.failed,
                             out.unresolvable)

    def scores(self, names: list[str], needs: PodNeeds, extra: dict[str, Any] | None, ask: DraAsk,
               dra_names: list[str]) -> list[int]:
        """DRA nodes scored by their offers (extender.placement.dra.rank); the request's other nodes as
        prioritize scores them (each path on its own scale). The best DRA node's offer is expected for the pod
        (DraView.expect) until its claim shows an allocation, so that the next pod of a burst is ranked on it."""
        dra = self._view()
        assert dra is not None
        own = set(dra_names)
        mine = [n for n in names if n in own]
        views = dra.nodes(mine, exclude_pod=needs.uid)
        scores, offers = rank(views, mine, ask)
        by_name = dict(zip(mine, scores, strict=True))
        others = [n for n in names if n not in own]
        if others and needs.size > 0:
            by_name.update(zip(others, self._scores(others, needs, extra, None), strict=True))
        best = max(range(len(mine)), key=lambda i: (scores[i], offers[i] is not None), default=None)
        if best is not None:
            offer = offers[best]
            if offer is not None:
                dra.expect(needs.uid, mine[best], offer.gpus)
        return [by_name.get(n, 0) for n in names]
