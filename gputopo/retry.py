"""The one retry policy: exponential backoff with jitter, from tenacity's wait strategy.

Our retries live inside long-running reconcile loops (watches, publication, kubelet registration) that must also
poll, wake on events and stop promptly, so they ask this object for the next delay rather than hand control to a
tenacity `Retrying` loop; the curve itself is tenacity's, in one place.
"""

from __future__ import annotations

import tenacity


class Backoff:
    """Delays after consecutive failures: `initial_s` x 2^(n-1) capped at `max_s`, plus up to `jitter_s` at random
    (so many nodes that lost the API server together do not come back in lockstep). `reset()` after a success."""

    def __init__(self, initial_s: float, max_s: float, *, jitter_s: float | None = None) -> None:
        if not 0 < initial_s <= max_s:
            raise ValueError(f"need 0 < initial_s <= max_s, got {initial_s} and {max_s}")
        self.initial_s = initial_s
        self.max_s = max_s
        jitter = initial_s if jitter_s is None else jitter_s
        self._wait = tenacity.wait_exponential_jitter(multiplier=initial_s, max=max_s, jitter=jitter)
        self._state = tenacity.RetryCallState(retry_object=tenacity.Retrying(), fn=None, args=(), kwargs={})
        self.failures = 0

    def delay(self, attempt: int) -> float:
        """The delay after the `attempt`-th consecutive failure (1-based), at most `max_s`."""
        self._state.attempt_number = max(1, attempt)
        return float(min(self.max_s, self._wait(self._state)))

    def failed(self) -> float:
        """Count one more failure; the delay before the next try."""
        self.failures += 1
        return self.delay(self.failures)

    def reset(self) -> None:
        self.failures = 0
