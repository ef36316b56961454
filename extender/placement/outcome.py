"""Filter's answer over one list of node names (FilterOutcome), built whole or patched by the nodes whose verdict
changed.

Under bind load every pod changes a few nodes, so the last answer over kube-scheduler's list (memo.LastAnswer) is
patched pod after pod. Rebuilding its three parts takes passes over every node (1.5 ms of a 5,000-node filter); a
patch takes the changed nodes only. What makes that hard is the reasons' grain (extender.placement.reasons): it is
chosen on the distinct reasons of the whole answer, so the tally counts them in each grain and a patch whose grain
differs from the last one's is rebuilt whole.

An outcome is shared by the requests that read it: a patch makes new lists and dicts, never changes the old ones
(prioritize's last answer compares its names with filter's passed list).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import Counter
from dataclasses import dataclass
from itertools import compress, repeat
from operator import is_
from typing import Any

from extender.placement import reasons
from extender.placement.reasons import Failed, Unresolvable

GRAINS = reasons.GRAINS


@dataclass
class FilterOutcome:
    passed: list[str]
    failed: dict[str, str]
    unresolvable: dict[str, str]


def outcome(names: list[str], verdicts: list[Any]) -> FilterOutcome:
    """The outcome whole: split by the verdict's type with C-level iterators, no Python code per node."""
    if verdicts.count(True) == len(names):
        return FilterOutcome(names, {}, {})
    kinds = list(map(type, verdicts))
    passed = list(compress(names, map(is_, kinds, repeat(bool))))
    failed_mask = list(map(is_, kinds, repeat(Failed)))
    unres_mask = list(map(is_, kinds, repeat(Unresolvable)))
    # kube-scheduler lists every distinct reason in the pod's event and condition: keep them few
    words = reasons.coarsened(verdicts)
    failed = dict(zip(compress(names, failed_mask), compress(words, failed_mask), strict=True))
    unresolvable = dict(zip(compress(names, unres_mask), compress(words, unres_mask), strict=True))
    return FilterOutcome(passed, failed, unresolvable)  # type: ignore[arg-type]


class OutcomeTally:
    """What a patch needs beside the answers: the positions of the passed nodes, and per grain how many nodes give
    each distinct reason with the characters the distinct ones take (reasons.coarsened's test)."""

    __slots__ = ("counts", "passed_at", "sums")

    def __init__(self, verdicts: list[Any]) -> None:
        text: Counter[Any] = Counter(verdicts)  # C-level; equal texts are one reason, as in reasons.coarsened
        text.pop(True, None)
        summary: Counter[str] = Counter()
        category: Counter[str] = Counter()
        for r, n in text.items():
            summary[getattr(r, "summary", r)] += n
            category[getattr(r, "category", r)] += n
        self.counts = (text, summary, category)
        self.sums = [sum(map(len, c)) for c in self.counts]
        self.passed_at = list(compress(range(len(verdicts)), map(is_, verdicts, repeat(True))))

    def grain(self) -> int:
        """reasons.finest_grain over the distinct reasons counted."""
        return reasons.finest_grain(self.sums.__getitem__)

    def count(self, verdict: Any, by: int) -> None:
        if verdict is True:
            return
        for g, key in enumerate((verdict, getattr(verdict, "summary", verdict), getattr(verdict, "category", verdict))):
            counts = self.counts[g]
            n = counts[key] + by
            if n:
                if n == by:
                    self.sums[g] += len(key)
                counts[key] = n
            else:
                del counts[key]
                self.sums[g] -= len(key)


def patched(tally: OutcomeTally, last: FilterOutcome, names: list[str], verdicts: list[Any],
            moves: list[tuple[int, Any]]) -> FilterOutcome:
    """The outcome after `moves` (position, new verdict), from the last one, which `verdicts` and `tally` still
    describe; both are brought up to date here."""
    before = tally.grain()
    for i, new in moves:
        tally.count(verdicts[i], -1)
        tally.count(new, 1)
    grain = tally.grain()
    if grain != before:  # every failed node's words change
        for i, new in moves:
            verdicts[i] = new
            _move_passed(tally.passed_at, None, i, new is True)
        return outcome(names, verdicts)
    passed, failed, unresolvable = last.passed.copy(), last.failed.copy(), last.unresolvable.copy()
    attr = GRAINS[grain]
    for i, new in moves:
        old, name = verdicts[i], names[i]
        verdicts[i] = new
        if old is True or new is True:
            _move_passed(tally.passed_at, passed, i, new is True, name)
        kind = type(old)
        if kind is Failed:
            del failed[name]
        elif kind is Unresolvable:
            del unresolvable[name]
        kind = type(new)
        if kind is Failed:
            failed[name] = new if grain == 0 else getattr(new, attr)
        elif kind is Unresolvable:
            unresolvable[name] = new if grain == 0 else getattr(new, attr)
    return FilterOutcome(passed, failed, unresolvable)


def _move_passed(at: list[int], passed: list[str] | None, i: int, passes: bool, name: str = "") -> None:
    """Node i joins or leaves the passed ones (kept in the names' order); a no-op when it is already so."""
    pos = bisect_left(at, i)
    present = pos < len(at) and at[pos] == i
    if passes and not present:
        at.insert(pos, i)
        if passed is not None:
            passed.insert(pos, name)
    elif not passes and present:
        del at[pos]
        if passed is not None:
            del passed[pos]
