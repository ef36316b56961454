"""Health per MIG instance: Xids carrying GI/CI ids, GPU-wide Xids, recovery; replayed on the virtual clock."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from gpuplugin.health import HealthMonitor, MigInstanceWatch
from gputopo.discovery.nvml import discover_node
from gputopo.discovery.nvml_backend import NVML_INSTANCE_ID_ANY, instance_id
from gputopo.discovery.nvml_replay import ReplayNvmlBackend, load_event_stream
from tests.fixtures.nvml import EVENTS, RECORDINGS, canonical, load_json

H100_MIXED = RECORDINGS / "synthetic-hgx-h100-80gb-8gpu-mig-mixed.json"


@dataclass
class MigRun:
    backend: ReplayNvmlBackend
    gpus: dict[int, str]
    uuids: dict[tuple[int, int, int], str]  # (gpu, gi, ci) -> MIG UUID
    whole: list[tuple[float, list[str], bool]] = field(default_factory=list)
    instances: list[tuple[float, list[str], bool]] = field(default_factory=list)

    def uuid(self, gpu: int, gi: int, ci: int = 0) -> str:
        return self.uuids[(gpu, gi, ci)]

    def on_gpu(self, gpu: int) -> set[str]:
        return {u for (g, _, _), u in self.uuids.items() if g == gpu}


def run_mig(stream: str, **options: Any) -> tuple[MigRun, HealthMonitor]:
    backend = ReplayNvmlBackend(canonical(H100_MIXED), load_event_stream(load_json(EVENTS / stream)))
    backend.init()
    node = discover_node(backend)
    watches = [MigInstanceWatch(m.nvml_index, d.gpu_instance_id, d.compute_instance_id, d.uuid)
               for m in node.mig for d in m.devices]
    run = MigRun(backend, node.nvml_index_to_id(),
                 {(w.gpu, w.gpu_instance, w.compute_instance): w.uuid for w in watches})
    monitor = HealthMonitor(
        backend,
        run.gpus,
        lambda ids, ok: run.whole.append((backend.clock(), list(ids), ok)),
        clock=backend.clock,
        probe_interval_s=5.0,
        mig_instances=watches,
        on_instance_change=lambda ids, ok: run.instances.append((backend.clock(), list(ids), ok)),
        **options,
    )
    monitor.start()
    try:
        assert backend.wait_drained(20), "the monitor did not consume the whole event stream"
    finally:
        monitor.stop()
    return run, monitor


def test_an_instance_xid_marks_that_instance_and_a_gpu_wide_xid_every_instance_of_the_gpu() -> None:
    run, monitor = run_mig("mig-instance-xids.json", recovery_s=None)
    # whole-GPU callers see only the whole GPU 1 (GPU 6 is MIG and not advertised whole; no instance Xid counted)
    assert [(ids, ok) for _, ids, ok in run.whole] == [([run.gpus[1]], False)]
    assert run.whole[0][0] == 30.0
    expected = {run.uuid(5, 3)} | run.on_gpu(6) | {run.uuid(7, 3, 0), run.uuid(7, 3, 1)}
    assert monitor.unhealthy_instances() == expected
    transitions = [(t, set(ids), ok) for t, ids, ok in run.instances]
    assert transitions[0] == (5.0, {run.uuid(5, 3)}, False)  # GI 3 / CI 0 of GPU 5 alone; the app Xid nothing
    assert transitions[1] == (15.0, run.on_gpu(6), False)
    assert transitions[2] == (20.0, {run.uuid(7, 3, 0), run.uuid(7, 3, 1)}, False)  # no CI id: the whole GI
    assert len(transitions) == 3  # GI 9 of GPU 7 holds nothing advertised: nothing marked
    assert monitor.is_instance_healthy(run.uuid(5, 1)) and monitor.is_instance_healthy(run.uuid(7, 1))
    assert monitor.is_instance_healthy("MIG-not-watched")
    assert monitor.unhealthy_ids() == {run.gpus[1]}


def test_instances_recover_like_whole_gpus() -> None:
    run, monitor = run_mig("mig-instance-xids.json", recovery_s=20)
    healed = {u: t for t, ids, ok in run.instances if ok for u in ids}
    # the instance of GPU 5: 20 s of passing probes after its Xid at t=5
    assert 5.0 + 20.0 <= healed[run.uuid(5, 3)] <= 5.0 + 20.0 + 5.0 + 1.0
    # GPU 6 answers again from t=40: its instances heal with it, 20 s later, not before
    for u in run.on_gpu(6):
        assert 40.0 + 20.0 <= healed[u] <= 40.0 + 20.0 + 5.0 + 1.0
    assert monitor.unhealthy_instances() == frozenset()
    assert monitor.unhealthy_ids() == frozenset()


def test_nvml_instance_ids_read_0xffffffff_as_gpu_wide() -> None:
    assert instance_id(NVML_INSTANCE_ID_ANY) is None and instance_id(None) is None
    assert instance_id(0) == 0 and instance_id(7) == 7


def test_a_mig_uuid_listed_twice_is_refused() -> None:
    backend = ReplayNvmlBackend(canonical(H100_MIXED))
    w = MigInstanceWatch(4, 1, 0, "MIG-x")
    with pytest.raises(ValueError, match="MIG-x"):
        HealthMonitor(backend, {}, lambda ids, ok: None, mig_instances=[w, w])


def test_a_repartition_changes_the_instances_watched() -> None:
    """After watch_instances (gpuplugin.sharing.mig_node after a re-partition) only the new set is reported: GPU 5's
    instance Xid finds no watched instance there, GPU 6's GPU-wide Xid marks GPU 6's instances."""
    backend = ReplayNvmlBackend(canonical(H100_MIXED), load_event_stream(load_json(EVENTS / "mig-instance-xids.json")))
    backend.init()
    node = discover_node(backend)
    watches = {m.nvml_index: [MigInstanceWatch(m.nvml_index, d.gpu_instance_id, d.compute_instance_id, d.uuid)
                              for d in m.devices] for m in node.mig}
    reported: list[tuple[list[str], bool]] = []
    monitor = HealthMonitor(backend, node.nvml_index_to_id(), lambda ids, ok: None, clock=backend.clock,
                            probe_interval_s=5.0, recovery_s=None, mig_instances=watches[5],
                            on_instance_change=lambda ids, ok: reported.append((list(ids), ok)))
    monitor.watch_instances(watches[6])
    monitor.start()
    try:
        assert backend.wait_drained(20)
    finally:
        monitor.stop()
    gpu6 = {w.uuid for w in watches[6]}
    assert monitor.unhealthy_instances() == gpu6
    assert [(set(ids), ok) for ids, ok in reported] == [(gpu6, False)]
