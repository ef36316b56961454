"""HealthMonitor driven by replayed NVML event streams (tests/fixtures/events) on the replay's virtual clock."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from gpuplugin.health import DEFAULT_IGNORED_XIDS, HealthMonitor
from gputopo.core.allocator import best_subset
from gputopo.discovery.nvml import discover_node
from gputopo.discovery.nvml_backend import NvmlBackend, NvmlError
from gputopo.discovery.nvml_replay import EventStreamError, ReplayNvmlBackend, load_event_stream
from tests.fixtures.nvml import EVENTS, HGX, canonical, load_json


@dataclass
class Run:
    backend: ReplayNvmlBackend
    ids: dict[int, str]  # NVML index -> device id (UUID)
    changes: list[tuple[float, list[str], bool, frozenset[str]]] = field(default_factory=list)

    def id(self, gpu: int) -> str:
        return self.ids[gpu]

    def transitions(self) -> list[tuple[list[int], bool]]:
        back = {v: k for k, v in self.ids.items()}
        return [([back[i] for i in ids], healthy) for _, ids, healthy, _ in self.changes]

    def time_of(self, gpu: int, healthy: bool) -> float:
        return next(t for t, ids, h, _ in self.changes if h is healthy and self.ids[gpu] in ids)


def run_stream(name: str, *, on_change_also: Any = None, **options: Any) -> tuple[Run, HealthMonitor]:
    """Replay `name` against the synthetic 8-GPU HGX recording until the stream is drained."""
    backend = ReplayNvmlBackend(canonical(HGX), load_event_stream(load_json(EVENTS / name)))
    backend.init()
    ids = discover_node(backend).nvml_index_to_id()
    run = Run(backend, ids)
    holder: dict[str, HealthMonitor] = {}

    def on_change(changed: list[str], healthy: bool) -> None:
        run.changes.append((backend.clock(), list(changed), healthy, holder["m"].unhealthy_ids()))
        if on_change_also is not None:
            on_change_also(changed, healthy)

    options.setdefault("probe_interval_s", 5.0)
    options.setdefault("wait_ms", 1000)
    monitor = HealthMonitor(backend, ids, on_change, clock=backend.clock, **options)
    holder["m"] = monitor
    monitor.start()
    try:
        assert backend.wait_drained(20), "the monitor did not consume the whole event stream"
    finally:
        monitor.stop()
    return run, monitor


def test_an_xid_storm_is_one_transition_and_application_xids_next_to_it_change_nothing() -> None:
    run, monitor = run_stream("xid-storm.json", recovery_s=60)
    assert run.transitions() == [([2], False)]
    assert run.changes[0][0] == 10.0
    assert monitor.unhealthy_ids() == {run.id(2)}


def test_a_lost_gpu_turns_unhealthy_alone_and_recovers_after_passing_probes() -> None:
    run, monitor = run_stream("gpu-lost.json", recovery_s=20)
    assert run.transitions() == [([3], False), ([5], False), ([3], True)]
    t_lost, _, _, unhealthy_then = run.changes[0]
    assert t_lost == 5.0 and unhealthy_then == {run.id(3)}  # the other seven stayed healthy
    # GPU 5 had no Xid: the probe found it within one probe interval.
    assert 12.0 <= run.time_of(5, False) <= 12.0 + 5.0 + 1.0
    # GPU 3 answers again from t=40: Healthy after 20 s of passing probes, not before.
    assert 40.0 + 20.0 <= run.time_of(3, True) <= 40.0 + 20.0 + 5.0 + 1.0
    assert monitor.unhealthy_ids() == {run.id(5)}


def test_without_recovery_a_lost_gpu_stays_unhealthy() -> None:
    run, monitor = run_stream("gpu-lost.json", recovery_s=None)
    assert run.transitions() == [([3], False), ([5], False)]
    assert monitor.unhealthy_ids() == {run.id(3), run.id(5)}


def test_application_xids_are_ignored_by_default() -> None:
    assert frozenset({13, 31, 43, 45, 68, 109}) == DEFAULT_IGNORED_XIDS
    run, monitor = run_stream("app-xids.json")
    assert run.changes == []
    assert monitor.unhealthy_ids() == frozenset()


def test_the_ignored_set_is_configurable() -> None:
    run, monitor = run_stream("app-xids.json", ignored_xids={31, 45}, recovery_s=None)
    hit = {0, 2, 4, 5, 6, 7}  # GPUs that saw 13, 43, 68, 109 (GPU 1 saw only 31, GPU 3 only 45)
    assert {g for ids, healthy in run.transitions() for g in ids if not healthy} == hit
    assert monitor.unhealthy_ids() == {run.id(g) for g in hit}


def test_a_second_xid_restarts_the_recovery_clock_and_an_unattributed_xid_hits_every_gpu() -> None:
    run, monitor = run_stream("relapse.json", recovery_s=30, error_backoff_s=0.01)
    assert run.transitions() == [([1], False), ([6], False), ([6], True), ([1], True), (list(range(8)), False)]
    assert 8.0 + 30.0 <= run.time_of(6, True) <= 8.0 + 30.0 + 5.0 + 1.0
    assert 20.0 + 30.0 <= run.time_of(1, True) <= 20.0 + 30.0 + 5.0 + 1.0  # not 5 + 30
    assert run.changes[-1][0] == 100.0
    # The failed nvmlEventSetWait at t=110 changed nothing and did not stop the monitor.
    assert monitor.unhealthy_ids() == frozenset(run.ids.values())


def test_allocation_keeps_working_on_the_healthy_gpus() -> None:
    from gpuplugin.deviceplugin.resource import ResourceManager

    topo = discover_node(_ready()).topology
    manager = ResourceManager(topo)
    run, _ = run_stream("gpu-lost.json", recovery_s=None, on_change_also=manager.set_health)
    assert set(manager.unhealthy_ids()) == {run.id(3), run.id(5)}
    healthy = [topo.index_of(i) for i in manager.healthy_ids()]
    assert best_subset(topo, healthy, 6).gpus == tuple(sorted(healthy))
    assert manager.preferred(manager.healthy_ids(), [], 4).ids  # the plugin still answers


def _ready() -> ReplayNvmlBackend:
    backend = ReplayNvmlBackend(canonical(HGX))
    backend.init()
    return backend


def test_a_crashing_callback_does_not_stop_the_monitor() -> None:
    calls: list[bool] = []

    def explode(ids: list[str], healthy: bool) -> None:
        calls.append(healthy)
        raise RuntimeError("boom")

    run, monitor = run_stream("gpu-lost.json", recovery_s=20, on_change_also=explode)
    assert calls == [False, False, True]
    assert monitor.unhealthy_ids() == {run.id(5)}


def test_a_custom_probe_decides_health() -> None:
    def probe(backend: NvmlBackend, gpu: int) -> None:
        backend.memory_total(gpu)
        if gpu == 4:
            raise NvmlError("EccPending", "retired pages pending", gpu=gpu)

    run, monitor = run_stream("app-xids.json", probe=probe, recovery_s=None)
    assert run.transitions() == [([4], False)]
    assert monitor.is_healthy(run.id(0)) and not monitor.is_healthy(run.id(4))


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([{"t": 2.0, "type": "xid", "gpu": 0, "xid": 48}, {"t": 1.0, "type": "xid", "gpu": 0, "xid": 48}],
         "comes before"),
        ([{"t": 1.0, "type": "fail", "gpu": 0}], "needs error"),
        ([{"t": 1.0, "type": "xid", "gpu": 0}], "needs xid"),
        ([{"t": -1.0, "type": "xid", "gpu": 0, "xid": 1}], "events.0.t"),
        ([{"t": 1.0, "type": "reboot", "gpu": 0}], "events.0.type"),
    ],
)
def test_malformed_event_streams_name_the_problem(events: list[dict], message: str) -> None:
    with pytest.raises(EventStreamError, match=message):
        load_event_stream({"format": "gpuplugin.nvml-events", "version": 1, "events": events})


def test_every_fixture_stream_is_valid_and_synthetic() -> None:
    paths: Iterable[Path] = sorted(EVENTS.glob("*.json"))
    assert len(list(paths)) >= 4
    for path in sorted(EVENTS.glob("*.json")):
        stream = load_event_stream(load_json(path))
        assert stream.description.startswith("Synthetic."), path.name
