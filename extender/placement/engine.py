"""Placement answers for filter, prioritize, preempt and bind, per node, over the node cache.

Three concerns, three modules: extender.placement.policy decides (best subset, packing value, island value),
extender.placement.memo remembers its answers per (topology fingerprint, free set, need) and per node state, and
extender.placement.reasons words the refusals. This module maps node names to states and states to answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from functools import partial
from typing import Any

from extender.placement import policy, reasons
from extender.placement.explain import Offer, offer
from extender.placement.memo import LastAnswer, PlacementMemo
from extender.placement.mig import MigChoiceOnNode, mig_choice, mig_scores
from extender.placement.outcome import FilterOutcome, OutcomeTally, outcome, patched
from extender.placement.policy import NO_FIT, Fit, island_values
from extender.placement.reasons import UNKNOWN_NODE, Failed, Unresolvable
from extender.placement.shared import SharedChoice, choice_key, shared_choice, shared_scores
from extender.state.cache import CORDONED, NodeCache, NodeEntry, PlacementState
from extender.state.pods import Need
from gputopo.contract import is_mig_resource
from gputopo.core import Allocation, Topology

__all__ = ["CORDONED", "MIG", "SHARED", "UNKNOWN_NODE", "WHOLE", "FilterOutcome", "Fit", "NoFit", "Placement",
           "Route", "island_values"]

# the path a need takes (Placement.route): whole GPUs, replicas of shared GPUs, MIG instances
WHOLE, SHARED, MIG = "whole", "shared", "mig"
Route = tuple[str, str]  # (the path, the resource it takes: "" for whole GPUs of the configured one)
_WHOLE_ROUTE: Route = (WHOLE, "")

# what is kept of a MIG answer by node name: (entry, pending instances, reserved mask, answer)
_MigKept = tuple[NodeEntry, frozenset[str], int, MigChoiceOnNode | Failed | Unresolvable]


class NoFit(Exception):
    """The pod cannot be placed on the node; `unresolvable` when no preemption on that node could change that."""

    def __init__(self, reason: str, unresolvable: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.unresolvable = unresolvable


class Placement:
    def __init__(self, cache: NodeCache) -> None:
        self.cache = cache
        self.memo = PlacementMemo(consolidate=cache.config.consolidate)
        cache.on_state_change.append(self.memo.forget)
        # the configured resource and its domain (the config is frozen): what route() compares with
        self._resource = cache.config.resource_name
        self._domain = self._resource.split("/", 1)[0]

    def fit(self, entry: NodeEntry, free: int, need: Need) -> Fit:
        """Best subset of `free` for the need on this node, with its packing value, or why there is none."""
        assert entry.topo is not None
        return self.memo.fit(entry.topo, free, need)

    def shortfall(self, entry: NodeEntry, reserved: int, size: int) -> str:
        """'needs 4 GPUs, 2 free: GPU 0,1 in use, GPU 5 unhealthy'."""
        reserved &= entry.base_free
        return reasons.shortfall(entry.used_mask, entry.unhealthy_mask, reserved, entry.base_free & ~reserved, size)

    def efficiency(self, topo: Topology, alloc: Allocation) -> float:
        return policy.efficiency(self.memo.facts(topo), alloc)

    def _state_fit(self, st: PlacementState, need: Need) -> Fit:
        return self.memo.fit(self.cache.topologies[st.fingerprint], st.free, need)

    # -- verbs ------------------------------------------------------------------------------------------------
    #
    # Both verbs map node names to answers through the memo's per-need table by name (forgotten per node as its
    # state changes), with a C-level map(): Python code runs only for nodes that changed since the last request.

    def _verdict(self, st: PlacementState | None, need: Need) -> bool | Failed | Unresolvable:
        """True (passes), or the reason, typed by whether preemption could help."""
        if st is None:
            return Unresolvable(UNKNOWN_NODE)
        if st.problem is not None:
            return Unresolvable(reasons.node_problem(st.problem))
        size, free = need.size, st.free
        if st.total < size:
            return Unresolvable(reasons.too_few_in_total(size, st.total))
        if free.bit_count() < size:
            return Failed(reasons.shortfall(st.used, st.unhealthy, st.reserved, free, size))
        if need.constrained:
            fit = self._state_fit(st, need)
            if fit.alloc is None:
                reason = fit.failure or reasons.DOES_NOT_FIT
                return Unresolvable(reason) if fit.unresolvable else Failed(reason)
        return True

    def filter(self, names: Iterable[str], need: Need, extra: Mapping[str, NodeEntry] | None = None) -> FilterOutcome:
        names = names if isinstance(names, list) else list(names)  # kept as is: memo.LastAnswer compares it
        if need.size == 0:
            return FilterOutcome(names, {}, {})
        kind, resource = self.route(need, extra)
        if kind == MIG:
            return self._filter_mig(names, need, resource, extra)
        if kind == SHARED:
            return self._filter_shared(names, need, resource, extra)
        if extra:
            return self._filter_whole(names, need, extra)
        return self._patched("filter", names, need, self.memo.verdicts(need), self._verdict, outcome,
                             self._patch_outcome)

    def _answers(self, verb: str, names: list[str], need: Need, extra: Mapping[str, NodeEntry] | None,
                 table: dict[Any, Any], compute: Callable[[PlacementState | None, Need], Any]) -> list[Any]:
        """The verb's answer per name: from the table by node name (one C-level lookup each), else from the table
        by node state, else computed. An answer is kept by name only while the node's state is the one it was
        computed from: written first, then checked against the cache's current state (NodeCache writes the state
        first, then forgets the name), so a change racing this request never leaves a stale answer behind."""
        by_name = self.memo.by_name(verb, need)
        answers = list(map(by_name.get, names))
        if None not in answers:
            return answers
        states = self.cache.states
        for i, a in enumerate(answers):
            if a is not None:
                continue
            name = names[i]
            st = states.get(name)
            known = st is not None
            if not known and extra and name in extra:
                st = self.cache.state_for(extra[name], 0)
            a = table.get(st) if st is not None else None
            if a is None:
                a = compute(st, need)
                if st is not None:
                    table[st] = a
            answers[i] = a
            if known:
                by_name[name] = a
                if states.get(name) is not st:
                    by_name.pop(name, None)
        return answers

    def _patched(self, verb: str, names: list[str], need: Need, table: dict[Any, Any],
                 compute: Callable[[PlacementState | None, Need], Any], build: Callable[[list[str], list[Any]], Any],
                 patch: Callable[[LastAnswer, list[str], list[Any], list[tuple[int, Any]]], Any] | None = None
                 ) -> Any:
        """The verb's result over the cache's nodes, from its last one where the request lists the same names
        (memo.LastAnswer): the answers of nodes changed since are recomputed, and the result rebuilt (or, with
        `patch`, patched by the answers that moved) only if one differs. The result is shared between requests:
        callers only read it."""
        last = self.memo.last(verb, need)
        if last is not None and last.answers is not None and last.names == names and last.busy.acquire(False):
            try:
                answers = last.answers
                changed = last.take_dirty()
                if changed:
                    fresh = self._answers(verb, [names[i] for i in changed], need, None, table, compute)
                    moves = [(i, a) for i, a in zip(changed, fresh, strict=True) if a is not answers[i]]
                    if moves and patch is not None:
                        last.result = patch(last, names, answers, moves)
                    elif moves:
                        for i, a in moves:
                            answers[i] = a
                        last.result = build(names, answers)
                return last.result
            finally:
                last.busy.release()
        last = self.memo.start_last(verb, need, names)
        answers = self._answers(verb, names, need, None, table, compute)
        result = build(names, answers)
        last.result, last.answers = result, answers
        return result

    @staticmethod
    def _patch_outcome(last: LastAnswer, names: list[str], verdicts: list[Any], moves: list[tuple[int, Any]]
                       ) -> FilterOutcome:
        if last.tally is None:  # the first patch of this answer: counted on the verdicts it was built from
            last.tally = OutcomeTally(verdicts)
        return patched(last.tally, last.result, names, verdicts, moves)

    def _filter_whole(self, names: list[str], need: Need, extra: Mapping[str, NodeEntry] | None) -> FilterOutcome:
        return outcome(names, self._answers("filter", names, need, extra, self.memo.verdicts(need), self._verdict))

    def _score_fit(self, st: PlacementState | None, need: Need) -> Fit:
        if st is None or st.problem is not None or st.total < need.size or st.free.bit_count() < need.size:
            return NO_FIT
        fit = self._state_fit(st, need)
        if fit.alloc is None:
            return NO_FIT
        return self.memo.value_class(policy.draining(fit) if st.draining else fit)

    def score(self, names: Iterable[str], need: Need, extra: Mapping[str, NodeEntry] | None = None) -> list[int]:
        """Scores 0-10 aligned with `names`."""
        names = names if isinstance(names, list) else list(names)  # kept as is: memo.LastAnswer compares it
        if need.size == 0:
            return [0] * len(names)
        route = self.route(need, extra)
        if route[0] != WHOLE:
            return self._score_offer(names, need, extra, route)[0]
        config = self.cache.config
        return policy.rank(self._fits(names, need, extra), config.island_penalty, config.island_spare).scores

    def score_offer(self, names: Iterable[str], need: Need, extra: Mapping[str, NodeEntry] | None = None
                    ) -> tuple[list[int], Offer | None]:
        """Scores as `score`, and what the best of the nodes offered (extender.placement.explain), for the
        explanation bind writes next to the plan."""
        names = names if isinstance(names, list) else list(names)  # kept as is: memo.LastAnswer compares it
        if need.size == 0:
            return [0] * len(names), None
        return self._score_offer(names, need, extra, self.route(need, extra))

    def _score_offer(self, names: list[str], need: Need, extra: Mapping[str, NodeEntry] | None, route: Route
                     ) -> tuple[list[int], Offer | None]:
        kind, resource = route
        if kind == MIG:
            return self._score_mig(names, need, resource, extra)
        if kind == SHARED:
            return self._score_shared(names, need, resource, extra)
        return self._score_whole(names, need, extra)

    def _score_whole(self, names: list[str], need: Need, extra: Mapping[str, NodeEntry] | None
                     ) -> tuple[list[int], Offer | None]:
        if not extra:
            return self._patched("score", names, need, self.memo.scores(need), self._score_fit,
                                 partial(self._ranked, need))
        return self._ranked(None, names, self._fits(names, need, extra))

    def _ranked(self, need: Need | None, names: list[str], fits: list[Fit]) -> tuple[list[int], Offer | None]:
        """With `need`, by the need's kept Ranker (the cache's nodes, request after request) when no other
        request is using it; else from scratch."""
        config = self.cache.config
        penalty, spare = config.island_penalty, config.island_spare
        ranker = self.memo.ranker(need, penalty, spare) if need is not None else None
        if ranker is not None and ranker.lock.acquire(False):
            try:
                ranking = ranker.rank(fits)
            finally:
                ranker.lock.release()
        else:
            ranking = policy.rank(fits, penalty, spare)
        return ranking.scores, offer(names, fits, ranking, penalty, spare)

    def _fits(self, names: list[str], need: Need, extra: Mapping[str, NodeEntry] | None) -> list[Fit]:
        return self._answers("score", names, need, extra, self.memo.scores(need), self._score_fit)

    # -- the path a need takes ---------------------------------------------------------------------------------
    #
    # Replicas or MIG instances only when the pod asks for such a resource, or the configured one is shared or cut
    # in MIG instances on some node: otherwise the verbs above run exactly as before (two set lookups more).

    def route(self, need: Need, extra: Mapping[str, NodeEntry] | None = None) -> Route:
        """(MIG, resource), (SHARED, resource) or (WHOLE, ""), once per verb: from the resource names the cache's
        nodes serve (NodeCache keeps `mig_names` and `shared_names` as nodes change, so this is set lookups), and
        one pass over the request's own unseen nodes when there are any. MIG first: a node that advertises MIG
        instances as the configured resource (NVIDIA's single strategy) serves it with them."""
        asked = need.resource
        if asked is not None:
            return (MIG, asked) if is_mig_resource(asked, self._domain) else (SHARED, asked)
        name = self._resource
        if name in self.cache.mig_names:
            return MIG, name
        shared = name in self.cache.shared_names
        if extra:
            for e in extra.values():
                if e.serves_mig(name):
                    return MIG, name
                shared = shared or e.shares(name)
        return (SHARED, name) if shared else _WHOLE_ROUTE

    def shared_resource(self, need: Need, extra: Mapping[str, NodeEntry] | None = None) -> str | None:
        """The resource whose replicas the need may take on some node (the cache's, or the request's own unseen
        ones); None: the MIG or whole-GPU path (route)."""
        kind, resource = self.route(need, extra)
        return resource if kind == SHARED else None

    def mig_resource(self, need: Need, extra: Mapping[str, NodeEntry] | None = None) -> str | None:
        """The resource whose MIG instances the need may take on some node; None: no MIG path (route)."""
        kind, resource = self.route(need, extra)
        return resource if kind == MIG else None

    # -- replicas of shared GPUs (extender.placement.shared) ---------------------------------------------------

    def shared_choice(self, entry: NodeEntry, resource: str, size: int, largest: int
                      ) -> SharedChoice | Failed | Unresolvable:
        """The node's answer, memoised on everything it depends on (nodes in equal states share it). `largest`: the
        most one container asks (Need.largest_request), what failRequestsGreaterThanOne bounds."""
        pending = self.cache.reservations.pending_replicas(entry.name)
        key = choice_key(entry, resource, size, pending, largest)
        if key is None:
            return shared_choice(entry, resource, size, pending, largest)
        table = self.memo.shared()
        hit = table.get(key)
        if hit is None:
            hit = table[key] = shared_choice(entry, resource, size, pending, largest)
        return hit

    def _split(self, names: list[str], need: Need, resource: str, extra: Mapping[str, NodeEntry] | None
               ) -> tuple[list[str], dict[str, SharedChoice | Failed | Unresolvable]]:
        """Nodes taking the pod whole (the configured resource, not shared there) and each other node's answer."""
        whole: list[str] = []
        shared: dict[str, SharedChoice | Failed | Unresolvable] = {}
        for name in names:
            entry = self.cache.nodes.get(name)
            if entry is None and extra:
                entry = extra.get(name)
            if entry is None:
                if need.resource is None:
                    whole.append(name)
                else:
                    shared[name] = Unresolvable(UNKNOWN_NODE)
            elif need.resource is None and not entry.shares(resource):
                whole.append(name)
            else:
                shared[name] = self.shared_choice(entry, resource, need.size, need.largest_request)
        return whole, shared

    def _filter_shared(self, names: list[str], need: Need, resource: str, extra: Mapping[str, NodeEntry] | None
                       ) -> FilterOutcome:
        whole, shared = self._split(names, need, resource, extra)
        out = self._filter_whole(whole, need, extra) if whole else FilterOutcome([], {}, {})
        refused = [(n, v) for n, v in shared.items() if isinstance(v, Failed | Unresolvable)]
        words = reasons.coarsened([v for _, v in refused])  # type: ignore[arg-type]
        for (name, v), w in zip(refused, words, strict=True):
            (out.unresolvable if isinstance(v, Unresolvable) else out.failed)[name] = w  # type: ignore[assignment]
        ok = set(out.passed) | {n for n, v in shared.items() if isinstance(v, SharedChoice)}
        return FilterOutcome([n for n in names if n in ok], out.failed, out.unresolvable)

    def _score_shared(self, names: list[str], need: Need, resource: str, extra: Mapping[str, NodeEntry] | None
                      ) -> tuple[list[int], Offer | None]:
        whole, shared = self._split(names, need, resource, extra)
        found = None
        scores: dict[str, int] = {}
        if whole:
            whole_scores, found = self._score_whole(whole, need, extra)
            scores.update(zip(whole, whole_scores, strict=True))
        choices = [v if isinstance(v, SharedChoice) else None for v in shared.values()]
        scores.update(zip(shared, shared_scores(choices), strict=True))
        return [scores[n] for n in names], found

    def choose_shared(self, entry: NodeEntry | None, resource: str, size: int, largest: int) -> SharedChoice:
        """The replicas bind commits to (the caller holds the node's lock). Raises NoFit. `largest`: the most one
        container asks (Need.largest_request), as filter read it, or bind refuses what filter let through."""
        if entry is None:
            raise NoFit(UNKNOWN_NODE, True)
        choice = self.shared_choice(entry, resource, size, largest)
        if not isinstance(choice, SharedChoice):
            raise NoFit(choice, isinstance(choice, Unresolvable))
        return choice

    # -- MIG instances (extender.placement.mig) ------------------------------------------------------------------
    #
    # A pod asking `<domain>/mig-<profile>`, or the configured resource where some node advertises MIG instances
    # under it (NVIDIA's single strategy).

    def mig_choice(self, entry: NodeEntry, resource: str, need: Need) -> MigChoiceOnNode | Failed | Unresolvable:
        """The node's answer: filter, prioritize and bind ask the same question in a row."""
        return self._mig_answer(entry, resource, need, self.memo.by_name(MIG, need, resource))

    def _mig_answer(self, entry: NodeEntry, resource: str, need: Need, kept: dict[str, _MigKept]
                    ) -> MigChoiceOnNode | Failed | Unresolvable:
        """The answer kept by node name with the others (PlacementMemo.by_name: forgotten as the node's state
        changes, gone with the node), valid only for the entry it was computed from: the placement state holds no
        MIG instance, so a newly published MIG state (a new entry: entries are replaced, never changed) must miss
        even where the state stayed the same; and for the instances and GPUs binds in flight hold."""
        name = entry.name
        pending = self.cache.reservations.pending_instances(name)
        reserved = self.cache.reservations.masks.get(name, 0) & ~entry.used_mask
        hit = kept.get(name)
        if hit is not None and hit[0] is entry and hit[1] == pending and hit[2] == reserved:
            return hit[3]
        whole = entry.used_ids
        if reserved and entry.topo is not None:
            ids = entry.topo.ids
            whole = whole | {ids[i] for i in range(entry.topo.size) if reserved >> i & 1}
        answer = mig_choice(entry, resource, need.size, pending, need.constrained, whole)
        if self.cache.nodes.get(name) is entry:  # the cache's nodes only: a request's unseen ones would pile up
            kept[name] = (entry, pending, reserved, answer)
        return answer

    def _split_mig(self, names: list[str], need: Need, resource: str, extra: Mapping[str, NodeEntry] | None
                   ) -> tuple[list[str], dict[str, MigChoiceOnNode | Failed | Unresolvable]]:
        """Nodes taking the pod whole (the configured resource, no MIG instance of it there) and each other
        node's answer."""
        whole: list[str] = []
        out: dict[str, MigChoiceOnNode | Failed | Unresolvable] = {}
        kept = self.memo.by_name(MIG, need, resource)
        for name in names:
            entry = self.cache.nodes.get(name)
            if entry is None and extra:
                entry = extra.get(name)
            if need.resource is None and (entry is None or not entry.serves_mig(resource)):
                whole.append(name)
            elif entry is None:
                out[name] = Unresolvable(UNKNOWN_NODE)
            else:
                out[name] = self._mig_answer(entry, resource, need, kept)
        return whole, out

    def _filter_mig(self, names: list[str], need: Need, resource: str, extra: Mapping[str, NodeEntry] | None
                    ) -> FilterOutcome:
        whole, answers = self._split_mig(names, need, resource, extra)
        out = self._filter_whole(whole, need, extra) if whole else FilterOutcome([], {}, {})
        refused = [(n, v) for n, v in answers.items() if isinstance(v, Failed | Unresolvable)]
        words = reasons.coarsened([v for _, v in refused])  # type: ignore[arg-type]
        for (name, v), w in zip(refused, words, strict=True):
            (out.unresolvable if isinstance(v, Unresolvable) else out.failed)[name] = w  # type: ignore[assignment]
        ok = set(out.passed) | {n for n, v in answers.items() if isinstance(v, MigChoiceOnNode)}
        return FilterOutcome([n for n in names if n in ok], out.failed, out.unresolvable)

    def _score_mig(self, names: list[str], need: Need, resource: str, extra: Mapping[str, NodeEntry] | None
                   ) -> tuple[list[int], Offer | None]:
        whole, answers = self._split_mig(names, need, resource, extra)
        found = None
        scores: dict[str, int] = {}
        if whole:
            whole_scores, found = self._score_whole(whole, need, extra)
            scores.update(zip(whole, whole_scores, strict=True))
        choices = [v if isinstance(v, MigChoiceOnNode) else None for v in answers.values()]
        scores.update(zip(answers, mig_scores(choices), strict=True))
        return [scores[n] for n in names], found

    def choose_mig(self, entry: NodeEntry | None, resource: str, need: Need) -> MigChoiceOnNode:
        """The instances bind commits to (the caller holds the node's lock). Raises NoFit."""
        if entry is None:
            raise NoFit(UNKNOWN_NODE, True)
        choice = self.mig_choice(entry, resource, need)
        if not isinstance(choice, MigChoiceOnNode):
            raise NoFit(choice, isinstance(choice, Unresolvable))
        return choice

    def choose(self, entry: NodeEntry | None, free: int, need: Need) -> Allocation:
        """The subset bind commits to (same allocator, same free set as filter/prioritize saw). Raises NoFit."""
        if entry is None:
            raise NoFit(UNKNOWN_NODE, True)
        if entry.topo is None:
            raise NoFit(entry.problem or reasons.NO_TOPOLOGY, True)
        if entry.total < need.size:
            raise NoFit(reasons.too_few_in_total(need.size, entry.total), True)
        if free.bit_count() < need.size:
            raise NoFit(self.shortfall(entry, entry.base_free & ~free, need.size))
        fit = self.fit(entry, free, need)
        if fit.alloc is None:
            raise NoFit(fit.failure or reasons.DOES_NOT_FIT, fit.unresolvable)
        return fit.alloc
