"""The one backoff policy (gputopo.retry.Backoff, tenacity's exponential wait with jitter)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gputopo.retry import Backoff


def test_doubles_from_initial_up_to_the_cap_without_jitter() -> None:
    backoff = Backoff(0.5, 30.0, jitter_s=0)
    assert [backoff.failed() for _ in range(9)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    backoff.reset()
    assert backoff.failures == 0 and backoff.failed() == 0.5


@given(initial=st.floats(0.001, 10), extra=st.floats(0, 100), attempt=st.integers(1, 10_000))
def test_jittered_delays_stay_between_the_curve_and_the_cap(initial: float, extra: float, attempt: int) -> None:
    cap = initial + extra
    backoff = Backoff(initial, cap)
    delay = backoff.delay(attempt)
    curve = min(cap, initial * 2 ** min(attempt - 1, 60))
    assert curve <= delay <= cap or delay == pytest.approx(cap)
    assert delay <= min(cap, curve + initial) + 1e-9


@pytest.mark.parametrize(("initial", "cap"), [(0, 1), (-1, 1), (2, 1)])
def test_bad_bounds_are_refused(initial: float, cap: float) -> None:
    with pytest.raises(ValueError, match="initial_s"):
        Backoff(initial, cap)
