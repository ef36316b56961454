"""The prepared claims (state.json) against the ResourceClaims that exist, at start and on a timer: a claim whose
ResourceClaim is gone (gpuplugin.dra.liveness) is released as an unprepare would release it (Driver.release).

Why a timer and not a watch: the kubelet unprepares a claim only while its checkpoint remembers it, so the claims
that need this are the ones no event will ever be about again (deleted while the driver was down, or while the
kubelet had forgotten them). Each pass reads the driver's state as it is now and looks each claim up (a consistent
GET from the apiserver); nothing carries over from one pass to the next but where the last one stopped.

Bounded: a pass looks up at most `max_lookups` claims and stops starting new lookups after `budget_s` (each GET is
bounded by the client's request timeout); the claims left over are looked up first by the next pass, which then
comes after `catch_up_s` instead of the full interval. A claim whose existence cannot be decided is kept, and the
pass says so in one warning line (repeated only when the undecided claims change; the gauge tells meanwhile).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from gpuplugin.dra.driver import Driver
from gpuplugin.dra.liveness import Finding, Verdict, judge
from gputopo.workers import Worker

log = structlog.get_logger(__name__)

MAX_LOOKUPS = 256  # per pass; a node's prepared claims are far fewer (one per pod using GPUs)
PASS_BUDGET_S = 30.0  # no lookup starts after this long into a pass
DEFAULT_INTERVAL_S = 60.0  # the kubelet's own unprepare loop of inactive pods runs every 60 s
CATCH_UP_S = 1.0  # the next pass, while claims were left unchecked
SHOWN = 8  # claims named in one log line


@dataclass(frozen=True)
class Outcome:
    """One pass: the UIDs released, found alive, left undecided, and not looked up (the bounds)."""

    released: tuple[str, ...]
    alive: tuple[str, ...]
    undecided: tuple[str, ...]
    unchecked: int


class Reconciler:
    def __init__(self, driver: Driver, *, max_lookups: int = MAX_LOOKUPS, budget_s: float = PASS_BUDGET_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_lookups < 1:
            raise ValueError(f"max_lookups must be at least 1, got {max_lookups}")
        self.driver = driver
        self.max_lookups = max_lookups
        self.budget_s = budget_s
        self._clock = clock
        self._last = ""  # the last UID looked up: the next pass starts after it, so every claim gets its turn
        self._undecided: frozenset[str] = frozenset()  # what the last warning was about

    def _order(self, uids: list[str]) -> list[str]:
        ordered = sorted(uids)
        later = [u for u in ordered if u > self._last]
        return later + [u for u in ordered if u <= self._last]

    def run_once(self) -> Outcome:
        """One pass (see the module docstring). A state that cannot be saved raises StateError: nothing is
        released, and the caller retries."""
        held = self.driver.prepared()
        deadline = self._clock() + self.budget_s
        findings: list[Finding] = []
        for uid in self._order(list(held))[:self.max_lookups]:
            if findings and self._clock() >= deadline:
                break
            findings.append(judge(held[uid], self.driver.get_claim))
            self._last = uid
        gone = [f for f in findings if f.verdict is Verdict.GONE]
        undecided = [f for f in findings if f.verdict is Verdict.UNDECIDED]
        released = self.driver.release([(held[f.uid], f.why) for f in gone]) if gone else []
        self.driver.metrics.undecided.set(len(undecided))
        if undecided:
            # a warning when the undecided claims change, not on every pass of a long apiserver outage
            now_undecided = frozenset(f.uid for f in undecided)
            (log.warning if now_undecided != self._undecided else log.debug)(
                "dra.state.undecided", count=len(undecided), error=undecided[0].why,
                claims=[f.claim for f in undecided[:SHOWN]],
                consequence="kept with their GPUs until the apiserver says whether they exist")
            self._undecided = now_undecided
        elif self._undecided:
            log.info("dra.state.decided", checked=len(findings), why="the apiserver answers for every claim again")
            self._undecided = frozenset()
        now = self.driver.prepared()  # re-read: the pass reports the state its actions left
        outcome = Outcome(tuple(released), tuple(f.uid for f in findings if f.verdict is Verdict.ALIVE),
                          tuple(f.uid for f in undecided), len(held) - len(findings))
        (log.info if released else log.debug)(
            "dra.state.reconciled", checked=len(findings), released=len(released), undecided=len(undecided),
            unchecked=outcome.unchecked, held=len(now))
        return outcome


class ClaimReconciler(Worker):
    """Runs `Reconciler.run_once` at start and every `interval_s` (sooner while claims were left unchecked); a
    pass that fails (the state file unwritable) is logged and retried after `retry_s`."""

    def __init__(self, reconciler: Reconciler, *, interval_s: float = DEFAULT_INTERVAL_S,
                 retry_s: float | None = None, catch_up_s: float = CATCH_UP_S) -> None:
        super().__init__("dra-claim-reconciler")
        self.reconciler = reconciler
        self.interval_s = interval_s
        self.retry_s = interval_s if retry_s is None else retry_s
        self.catch_up_s = min(catch_up_s, interval_s)

    def step(self) -> float:
        outcome = self.reconciler.run_once()
        return self.catch_up_s if outcome.unchecked else self.interval_s

    def loop(self) -> None:
        self.run_passes(self.step, retry_s=self.retry_s,
                        failed=lambda: log.exception("dra.reconcile.pass_failed", retry_in_s=self.retry_s))
