"""Leader election on a Lease (gputopo.kube.election) against the fake apiserver's Leases: one holder at a time, a
stopped holder hands over within a retry period, a partitioned one stops acting before anyone else may take over."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from gputopo.kube import make_api_client
from gputopo.kube.election import ElectionError, ElectionSettings, LeaderElector
from gputopo.settings import lease_timing_problem
from tests.fakes.kubeapi import FakeLeasesKubeApi
from tests.helpers.polling import eventually, scaled

NS, NAME = "gpu-topology", "gpu-extender"
FAST = {"lease_duration_s": 3, "renew_deadline_s": 2, "retry_period_s": 1}


@pytest.fixture
def leases() -> Iterator[FakeLeasesKubeApi]:
    with FakeLeasesKubeApi() as server:
        yield server


class Candidate:
    def __init__(self, fake: FakeLeasesKubeApi, identity: str) -> None:
        self.api = make_api_client(host=fake.url, timeout_s=2.0)
        self.started = threading.Event()
        self.lost = threading.Event()
        self.elector = LeaderElector(self.api, ElectionSettings(NAME, NS, identity, **FAST),
                                     on_started=self.started.set, on_lost=self.lost.set)

    def stop(self) -> None:
        self.elector.stop()
        self.api.close()


@pytest.fixture
def candidates(leases: FakeLeasesKubeApi) -> Iterator[list[Candidate]]:
    made = [Candidate(leases, "a"), Candidate(leases, "b")]
    try:
        yield made
    finally:
        for c in made:
            c.stop()


def _never_both(candidates: list[Candidate], seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        assert sum(c.elector.leading for c in candidates) <= 1
        time.sleep(0.01)


def test_one_candidate_leads_and_a_stopped_leader_hands_over_within_a_retry_period(
        leases: FakeLeasesKubeApi, candidates: list[Candidate]) -> None:
    a, b = candidates
    a.elector.start()
    assert a.started.wait(5) and a.elector.leading
    b.elector.start()
    _never_both(candidates, 2.5)  # b keeps trying for longer than the lease: a renews it
    assert leases.holder(NS, NAME) == "a" and not b.elector.leading and b.elector.holder() == "a"
    stopped = time.monotonic()
    a.elector.stop()
    assert not a.elector.leading and not a.lost.is_set()  # stopping is no loss
    assert b.started.wait(5)
    assert time.monotonic() - stopped < FAST["retry_period_s"] + 1.0  # the released lease, not its expiry
    assert leases.holder(NS, NAME) == "b" and b.elector.leading


def test_a_partitioned_leader_stops_before_the_lease_can_be_taken(
        leases: FakeLeasesKubeApi, candidates: list[Candidate]) -> None:
    a, b = candidates
    a.elector.start()
    assert a.started.wait(5)
    b.elector.start()
    time.sleep(1.2)
    a.api.configuration.host = "http://127.0.0.1:9"  # a can no longer reach the apiserver; b still can
    cut = time.monotonic()
    samples: list[tuple[float, bool, bool]] = []
    while time.monotonic() - cut < scaled(10):
        samples.append((time.monotonic() - cut, a.elector.leading, b.elector.leading))
        if samples[-1][2]:
            break
        time.sleep(0.01)
    # `leading` turns true a moment before on_started runs, on the elector's thread
    assert b.started.wait(scaled(5)), "the standby never took the expired lease"
    assert not any(x and y for _, x, y in samples)
    a_stopped = next(t for t, x, _ in samples if not x)
    b_took = next(t for t, _, y in samples if y)
    # a stops at its renew deadline, before the lease it last renewed can expire and be taken
    assert a_stopped < b_took and a_stopped <= FAST["lease_duration_s"]
    assert a.lost.wait(FAST["renew_deadline_s"] + FAST["retry_period_s"] + 2)  # and it says so, once it gives up


def test_an_unreachable_apiserver_is_retried_not_the_end_of_the_campaign(leases: FakeLeasesKubeApi) -> None:
    c = Candidate(leases, "late")
    try:
        c.api.configuration.host = "http://127.0.0.1:9"
        c.elector.start()
        time.sleep(1.5)
        assert c.elector.running and not c.elector.leading
        c.api.configuration.host = leases.url
        assert c.started.wait(5) and c.elector.leading
    finally:
        c.stop()


def test_it_waits_until_ready_before_it_runs(leases: FakeLeasesKubeApi) -> None:
    ready = threading.Event()
    api = make_api_client(host=leases.url, timeout_s=2.0)
    elector = LeaderElector(api, ElectionSettings(NAME, NS, "x", **FAST), wait_for=ready.is_set)
    try:
        elector.start()
        time.sleep(0.5)
        assert leases.lease(NS, NAME) is None
        ready.set()
        eventually(lambda: elector.leading, 5)
    finally:
        elector.stop()
        api.close()


@pytest.mark.parametrize(("durations", "words"), [
    ((10, 10, 2), "lease duration (10 s) must be longer than the renew deadline (10 s)"),
    ((15, 2, 2), "renew deadline (2 s) must be longer than 1.2 x the retry period (2 s)"),
    ((15, 10, 0), "at least 1 s"),
])
def test_durations_the_library_would_exit_on_are_refused_with_one_line(durations: tuple[int, int, int],
                                                                      words: str) -> None:
    assert words in (lease_timing_problem(*durations) or "")
    with pytest.raises(ElectionError, match=words.replace("(", r"\(").replace(")", r"\)")):
        ElectionSettings(NAME, NS, "x", *durations)
    assert lease_timing_problem(15, 10, 2) is None
