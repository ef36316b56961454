"""A filter answer patched by the nodes whose verdict moved (extender.placement.outcome) equals the answer built
whole, in every grain of the reasons and across the changes of grain, and never changes an answer handed out."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from extender.placement.outcome import FilterOutcome, OutcomeTally, outcome, patched
from extender.placement.reasons import MAX_REASONS_CHARS, Failed, Unresolvable

# texts long enough that a few distinct ones pass MAX_REASONS_CHARS, summaries that pass it in larger numbers,
# and categories that always fit: every grain is reached, and left
WIDE = MAX_REASONS_CHARS // 4


def _reason(kind: type, k: int) -> Any:
    return kind(f"text {k} " + "t" * WIDE, summary=f"summary {k % 6} " + "s" * (WIDE // 2),
                category=f"category {k % 2}")


POOL: list[Any] = [True, *(_reason(Failed, k) for k in range(8)), *(_reason(Unresolvable, k) for k in range(8, 12))]
verdict = st.sampled_from(range(len(POOL)))


def _pairs(out: FilterOutcome) -> tuple[list[str], dict[str, str], dict[str, str]]:
    return list(out.passed), dict(out.failed), dict(out.unresolvable)


@settings(max_examples=300, deadline=None)
@given(st.lists(verdict, min_size=1, max_size=40),
       st.lists(st.lists(st.tuples(st.integers(0, 39), verdict), min_size=1, max_size=6), max_size=25))
def test_patched_outcomes_equal_whole_ones(start: list[int], steps: list[list[tuple[int, int]]]) -> None:
    names = [f"n{i}" for i in range(len(start))]
    verdicts = [POOL[k] for k in start]
    last = outcome(names, verdicts)
    tally = OutcomeTally(verdicts)
    handed_out: list[tuple[FilterOutcome, Any]] = []
    for step in steps:
        moves: dict[int, Any] = {}
        for i, k in step:
            i %= len(names)
            if POOL[k] is not verdicts[i]:
                moves[i] = POOL[k]
        if not moves:
            continue
        handed_out.append((last, copy.deepcopy(_pairs(last))))
        last = patched(tally, last, names, verdicts, list(moves.items()))
        assert [verdicts[i] for i in moves] == list(moves.values())  # brought up to date
        whole = outcome(names, verdicts)
        assert last == whole
        assert tally.passed_at == [i for i, v in enumerate(verdicts) if v is True]
        assert tally.grain() == OutcomeTally(verdicts).grain()
        for out, seen in handed_out:  # an answer already read by a request stays as it was
            assert _pairs(out) == seen
