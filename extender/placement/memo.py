"""Placement answers already worked out, so thousands of nodes cost a few dict lookups.

Every answer depends only on (topology fingerprint, free GPU set, pod need): nodes of one model in the same state
share one computation, and the core's own memo (keyed the same way) stays warm. Two layers:
- fits, keyed (fingerprint, free set, need): the policy's answer for one node state;
- per-need tables, keyed by the node's PlacementState (which hashes its whole state key once): filter's verdict and
  prioritize's Fit, looked up with C-level map() calls so a request runs Python code only for states not seen before.

The tables are plain dicts with no lock of their own: single get/set/clear calls are atomic under the GIL, and a
lost race only computes the same pure answer twice. The fits and each per-need table are bounded (when full they
start over); the facts grow with the number of distinct topologies only, like the node cache's own table of them.
"""

from __future__ import annotations

from typing import Any

from extender.placement.policy import Fit, TopologyFacts, compute_fit
from extender.state.pods import Need
from gputopo.core import Topology

MEMO_LIMIT = 200_000

NeedKey = tuple[int, bool, float]


def need_key(need: Need) -> NeedKey:
    """A plain tuple (hashed in C) for memo keys: the dataclass's own hash runs Python code per call."""
    return (need.size, need.require_nvlink, need.min_gbps)


class PlacementMemo:
    def __init__(self, limit: int = MEMO_LIMIT) -> None:
        self.limit = limit
        self._facts: dict[str, TopologyFacts] = {}
        self._fits: dict[tuple[str, int, NeedKey], Fit] = {}
        self._verdicts: dict[NeedKey, dict[Any, Any]] = {}
        self._scores: dict[NeedKey, dict[Any, Any]] = {}
        self._shared: dict[Any, Any] = {}

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
        fit = compute_fit(self.facts(topo), free, need)
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
