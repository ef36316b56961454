"""Placement answers already worked out, so thousands of nodes cost a few dict lookups.

Every answer depends only on (topology fingerprint, free GPU set, pod need): nodes of one model in the same state
share one computation, and the core's own memo (keyed the same way) stays warm. Two layers:
- fits, keyed (fingerprint, free set, need): the policy's answer for one node state;
- per-need tables, keyed by the node's PlacementState (which hashes its whole state key once): filter's verdict and
  prioritize's Fit, looked up with C-level map() calls so a request runs Python code only for states not seen before;
- per-need tables keyed by node name (`by_name`): the same answers for the cache's nodes, forgotten for a node when
  its state changes (NodeCache.on_state_change), so a request over thousands of names is one C-level lookup per
  name, without mapping names to states first (issue 24: that mapping was a sixth of the pair at 5,000 nodes).
  MIG answers are kept there too (per need and asked resource), each with the node entry it was computed from.
Prioritize's Fits are kept one per value class (`value_class`): nodes whose best subsets differ but whose GB/s,
packing and islands are equal score alike, so the ranking values a few hundred classes, not every distinct state.

The tables are plain dicts with no lock of their own: single get/set/clear calls are atomic under the GIL, and a
lost race only computes the same pure answer twice. The fits and each per-need table are bounded (when full they
start over); the facts grow with the number of distinct topologies only, like the node cache's own table of them.
"""

from __future__ import annotations

import threading
from typing import Any

from extender.placement.policy import Fit, Ranker, TopologyFacts, compute_fit
from extender.state.pods import Need
from gputopo.core import Topology

MEMO_LIMIT = 200_000
BY_NAME_NEEDS = 64  # distinct needs with tables by node name (a pod's bandwidth floor is its own): past it, start over

NeedKey = tuple[int, bool, float]


def need_key(need: Need) -> NeedKey:
    """A plain tuple (hashed in C) for memo keys: the dataclass's own hash runs Python code per call."""
    return (need.size, need.require_nvlink, need.min_gbps)


class LastAnswer:
    """A verb's last whole answer for one need over one list of node names (issue 24: kube-scheduler sends the same
    list, every node, pod after pod), with the names whose state changed since: the next request over an equal list
    recomputes only those nodes' answers, and the verb's result only if one of them changed. `marks` (the state
    changes) may come from any thread; `busy` keeps two requests from patching one answer at once."""

    __slots__ = ("_dirty", "_index", "_lock", "answers", "busy", "names", "result", "tally")

    def __init__(self, names: list[str]) -> None:
        self.names = names
        self.answers: list[Any] | None = None  # None until the answer registered for it is complete
        self.result: Any = None
        self.tally: Any = None  # what the verb's patch keeps beside the result (extender.placement.outcome)
        self._index: dict[str, int] | None = None
        self._dirty: set[str] = set()
        self._lock = threading.Lock()
        self.busy = threading.Lock()

    def mark(self, name: str) -> None:
        with self._lock:
            self._dirty.add(name)

    def take_dirty(self) -> list[int]:
        """Positions in `names` of the nodes changed since the last take."""
        if not self._dirty:
            return []
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        if self._index is None:
            self._index = dict(zip(self.names, range(len(self.names)), strict=True))
        index = self._index
        return [index[n] for n in dirty if n in index]


class PlacementMemo:
    def __init__(self, limit: int = MEMO_LIMIT, consolidate: bool = True) -> None:
        self.limit = limit
        self.consolidate = consolidate
        self._facts: dict[str, TopologyFacts] = {}
        self._fits: dict[tuple[str, int, NeedKey], Fit] = {}
        self._verdicts: dict[NeedKey, dict[Any, Any]] = {}
        self._scores: dict[NeedKey, dict[Any, Any]] = {}
        self._shared: dict[Any, Any] = {}
        self._by_name: dict[tuple[str, NeedKey, str | None], dict[str, Any]] = {}
        self._classes: dict[tuple[float, float, tuple[tuple[int, float, float], ...]], Fit] = {}
        self._last: dict[tuple[str, NeedKey], LastAnswer] = {}
        self._rankers: dict[NeedKey, Ranker] = {}

    def facts(self, topo: Topology) -> TopologyFacts:
        hit = self._facts.get(topo.fingerprint)
        if hit is None:
            hit = self._facts[topo.fingerprint] = TopologyFacts(topo)
        return hit

    def fit(self, topo: Topology, free: int, need: Need) -> Fit:
        key = (topo.fingerprint, free, need_key(need))
        hit = self._fits.get(key)
        if hit is not None:
            return hit
        fit = compute_fit(self.facts(topo), free, need, self.consolidate)
        if len(self._fits) >= self.limit:
            self._fits.clear()
        self._fits[key] = fit
        return fit

    def verdicts(self, need: Need) -> dict[Any, Any]:
        """Filter's table for this need: node state -> True or the typed reason."""
        return self._table(self._verdicts, need)

    def scores(self, need: Need) -> dict[Any, Any]:
        """Prioritize's table for this need: node state -> Fit (NO_FIT where the pod cannot go)."""
        return self._table(self._scores, need)

    def by_name(self, verb: str, need: Need, resource: str | None = None) -> dict[str, Any]:
        """The verb's answers for this need (and asked `resource`) by node name; NodeCache's nodes only. 'filter':
        verdict, 'score': Fit, 'mig': what extender.placement.engine keeps of a MIG answer (it checks the entry)."""
        key = (verb, need_key(need), resource)
        table = self._by_name.get(key)
        if table is None:
            if len(self._by_name) >= BY_NAME_NEEDS:
                self._by_name = {}
            table = self._by_name.setdefault(key, {})
        return table

    def forget(self, name: str) -> None:
        """The node's state changed: its answers by name go, and the last answers mark it (the tables' lists are
        copied in C: no lock needed)."""
        for table in list(self._by_name.values()):
            table.pop(name, None)
        for last in list(self._last.values()):
            last.mark(name)

    def last(self, verb: str, need: Need) -> LastAnswer | None:
        return self._last.get((verb, need_key(need)))

    def start_last(self, verb: str, need: Need, names: list[str]) -> LastAnswer:
        """A new last answer over `names`, registered before it is computed: a state change during the computation
        marks it, so the next request recomputes that node rather than trust an answer computed before it."""
        if len(self._last) >= BY_NAME_NEEDS:
            self._last = {}
        last = self._last[(verb, need_key(need))] = LastAnswer(names)
        return last

    def ranker(self, need: Need, penalty: float, spare: int) -> Ranker:
        """Prioritize's ranking for this need, kept from one request to the next (policy.Ranker)."""
        nk = need_key(need)
        hit = self._rankers.get(nk)
        if hit is None:
            if len(self._rankers) >= BY_NAME_NEEDS:
                self._rankers = {}
            hit = self._rankers.setdefault(nk, Ranker(penalty, spare))
        return hit

    def value_class(self, fit: Fit) -> Fit:
        """One Fit per (GB/s, packing, islands): all prioritize reads of a fit (policy.rank, explain.offer)."""
        if fit.alloc is None:
            return fit
        key = (fit.gbps, fit.packing, fit.islands)
        hit = self._classes.get(key)
        if hit is None:
            if len(self._classes) >= self.limit:
                self._classes = {}
            hit = self._classes.setdefault(key, fit)
        return hit

    def shared(self) -> dict[Any, Any]:
        """Shared placement's answers (extender.placement.shared), keyed by all they depend on (its choice_key)."""
        if len(self._shared) >= self.limit:
            self._shared = {}
        return self._shared

    def _table(self, tables: dict[NeedKey, dict[Any, Any]], need: Need) -> dict[Any, Any]:
        nk = need_key(need)
        table = tables.get(nk)
        if table is None or len(table) >= self.limit:
            table = tables[nk] = {}
        return table
