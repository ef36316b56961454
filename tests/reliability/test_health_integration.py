"""GPU health faults end to end: replayed NVML (tests/fixtures/events and generated storms) -> HealthMonitor, wired
by `gpuplugin run`'s own `start_health` -> ResourceManager -> ListAndWatch -> what the simulated kubelet lists and
may allocate.

tests/gpuplugin/test_health.py checks the monitor's decisions on the virtual clock; this checks their effect on the
kubelet's view while the plugin serves. The replay's virtual clock is halted at chosen points (SteppedReplay) so the
test can look at the node mid-fault, then let the stream go on. The monitor itself runs on the real clock, as in
`gpuplugin run`, with a short probe interval and recovery time.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from gpuplugin.commands.run import Discovered, start_health
from gpuplugin.config import PluginConfig
from gpuplugin.deviceplugin.resource import ResourceManager
from gputopo.discovery.nvml import discover_node
from gputopo.discovery.nvml_backend import XidEventSet
from gputopo.discovery.nvml_replay import ReplayNvmlBackend, load_event_stream
from sim.kubelet import AdmissionError, KubeletSimulator, SimDevice
from tests.fixtures.nvml import EVENTS, HGX, canonical, load_json
from tests.gpuplugin.deviceplugin.conftest import RESOURCE, sample
from tests.reliability.conftest import WAIT, RawStream, ThreadBaseline, options_call, running_plugin

PROBE_S = 0.05
RECOVERY_S = 0.3


class SteppedReplay:
    """A ReplayNvmlBackend whose virtual clock halts at each hold point until `release()`. While held, the Xid wait
    returns nothing (real time passes in short steps), so the monitor keeps probing a frozen NVML state."""

    def __init__(self, replay: ReplayNvmlBackend, holds: Sequence[float]) -> None:
        self._replay = replay
        self._holds = sorted(holds)
        self._cond = threading.Condition()
        self._held_waits = 0

    def __getattr__(self, name: str) -> Any:  # every other NVML call: the replay's answer
        return getattr(self._replay, name)

    def xid_event_set(self, gpus: Iterable[int]) -> XidEventSet:
        events = self._replay.xid_event_set(gpus)

        def wait(timeout_ms: int) -> Any:
            with self._cond:
                if self._holds and self._replay.clock() >= self._holds[0]:
                    self._held_waits += 1
                    self._cond.notify_all()
                    self._cond.wait(min(timeout_ms / 1000.0, 0.02))
                    return None
            return events.wait(timeout_ms)

        return XidEventSet(events.registered, events.failed, wait, events.close)

    def wait_held(self, timeout: float = WAIT) -> bool:
        """True once the monitor has made a whole pass at the hold point: every event before it is reported."""
        with self._cond:
            return self._cond.wait_for(lambda: self._held_waits >= 2, timeout)

    def release(self) -> None:
        with self._cond:
            self._holds.pop(0)
            self._held_waits = 0
            self._cond.notify_all()


def stepped(stream: dict[str, Any], holds: Sequence[float]) -> SteppedReplay:
    replay = ReplayNvmlBackend(canonical(HGX), load_event_stream(stream))
    replay.init()
    return SteppedReplay(replay, holds)


@dataclass
class Node:
    sim: KubeletSimulator
    manager: ResourceManager
    stream: RawStream
    ids: list[str]  # advertised id per NVML index

    def unhealthy(self) -> set[str]:
        return {d.id for d in self.sim.devices(RESOURCE) if not d.healthy}

    def wait_unhealthy(self, want: set[str]) -> list[SimDevice]:
        """Wait until the kubelet's view lists exactly `want` as Unhealthy (and all 8 devices)."""
        return self.sim.wait_until(
            RESOURCE, lambda ds: len(ds) == 8 and {d.id for d in ds if not d.healthy} == want, WAIT
        )

    def transitions(self) -> float:
        return sum(sample(self.manager, "gpuplugin_health_transitions_total", to=to) for to in ("healthy", "unhealthy"))


@contextmanager
def node_with_health(plugin_dir: Path, backend: SteppedReplay, **health: Any) -> Iterator[Node]:
    """The plugin wired as `gpuplugin run` wires it: discovery's NVML indices into the resource manager, then
    `start_health(cfg, found, manager)` feeding `manager.set_health`."""
    node = discover_node(backend)
    found = Discovered(
        node.topology,
        minors={i: d.minor for i, d in enumerate(node.devices) if d.minor is not None},
        nvml_indices={i: d.nvml_index for i, d in enumerate(node.devices)},
        backend=backend,
    )
    cfg = PluginConfig(
        device_plugin_dir=plugin_dir, metrics_port=0, publish=False, health_probe_interval=PROBE_S, **health
    )
    manager = ResourceManager(found.topology, minors=found.minors, nvml_indices=found.nvml_indices)
    ids = [node.nvml_index_to_id()[i] for i in range(8)]
    with KubeletSimulator(plugin_dir) as sim, running_plugin(manager, plugin_dir):
        sim.wait_for_devices(RESOURCE, 8, WAIT)
        with RawStream(plugin_dir) as stream:
            assert stream.wait_for(lambda m: len(m) == 1)
            monitor = start_health(cfg, found, manager)
            assert monitor is not None
            try:
                yield Node(sim, manager, stream, ids)
            finally:
                monitor.stop()


def assert_no_flood(node: Node) -> None:
    """One ListAndWatch message per change at most, and never the same list twice in a row."""
    messages = list(node.stream.messages)
    assert len(messages) - 1 <= node.transitions()
    assert all(a != b for a, b in itertools.pairwise(messages)), "a repeated list was sent"


def test_a_gpu_that_stops_answering_turns_unhealthy_alone_and_recovers(
    plugin_dir: Path, threads: ThreadBaseline
) -> None:
    """gpu-lost.json: GPU 3 falls off the bus at t=5 (Xid 79, then GPU_IS_LOST), GPU 5 stops answering at t=12
    without an Xid; GPU 3 answers again from t=40."""
    replay = stepped(load_json(EVENTS / "gpu-lost.json"), holds=[30.0, 80.0])
    with node_with_health(plugin_dir, replay, health_recovery=RECOVERY_S) as node:
        lost, silent = node.ids[3], node.ids[5]
        assert replay.wait_held()
        devices = node.wait_unhealthy({lost, silent})
        healthy = [d.id for d in devices if d.healthy]
        # Admission keeps working for the six others; the lost one is refused with a reason.
        assert sorted(node.sim.preferred_raw(RESOURCE, healthy, [], 4)) == sorted(
            node.sim.preferred(RESOURCE, healthy, [], 4)
        )
        assert set(node.sim.preferred_raw(RESOURCE, healthy, [], 6)) == set(healthy)
        node.sim.allocate(RESOURCE, healthy)
        with pytest.raises(AdmissionError) as refused:
            node.sim.allocate(RESOURCE, [healthy[0], lost])
        assert refused.value.code is grpc.StatusCode.INVALID_ARGUMENT
        assert lost in refused.value.details and "unhealthy" in refused.value.details
        # Recovery: GPU 3 answers from t=40; after RECOVERY_S of passing probes it is Healthy again.
        replay.release()
        assert replay.wait_held()
        node.wait_unhealthy({silent})
        assert node.sim.allocate(RESOURCE, [lost]).envs["NVIDIA_VISIBLE_DEVICES"] == lost
        with pytest.raises(AdmissionError):
            node.sim.allocate(RESOURCE, [silent])
        assert sample(node.manager, "gpuplugin_health_transitions_total", to="unhealthy") == 2
        assert sample(node.manager, "gpuplugin_health_transitions_total", to="healthy") == 1
        assert node.stream.latest() == {i: "Unhealthy" if i == silent else "Healthy" for i in node.ids}
        assert_no_flood(node)
    threads.assert_none_leaked()


STORM_GPUS = (1, 4, 6)
CRITICAL = (48, 63, 64, 74, 79, 92, 94, 95)


def xid_storm(per_gpu: int = 150, start: float = 10.0, step: float = 0.004) -> dict[str, Any]:
    """Critical Xids on three GPUs, interleaved, with application Xids on two others, `per_gpu` rounds."""
    events: list[dict[str, Any]] = []
    for k in range(per_gpu):
        t = round(start + k * step, 6)
        for n, gpu in enumerate(STORM_GPUS):
            events.append({"t": t, "type": "xid", "gpu": gpu, "xid": CRITICAL[(k + n) % len(CRITICAL)]})
        events.append({"t": t, "type": "xid", "gpu": 0, "xid": 13})
        events.append({"t": t, "type": "xid", "gpu": 2, "xid": 43})
    return {"format": "gpuplugin.nvml-events", "version": 1, "description": "Synthetic. Generated Xid storm.",
            "end": start + per_gpu * step + 5.0, "events": events}


def test_an_xid_storm_on_several_gpus_marks_them_once_and_the_plugin_stays_responsive(
    plugin_dir: Path, threads: ThreadBaseline
) -> None:
    storm = xid_storm()
    mid, end = 10.3, storm["end"]
    replay = stepped(storm, holds=[mid, end])
    with node_with_health(plugin_dir, replay, health_recovery="never") as node:
        hit = {node.ids[g] for g in STORM_GPUS}
        assert replay.wait_held()  # in the middle of the storm
        devices = node.wait_unhealthy(hit)
        healthy = [d.id for d in devices if d.healthy]
        assert options_call(plugin_dir).get_preferred_allocation_available
        assert set(node.sim.preferred(RESOURCE, healthy, [], 5)) == set(healthy)
        node.sim.allocate(RESOURCE, healthy)
        replay.release()
        assert replay.wait_held()  # the storm is over
        assert node.unhealthy() == hit
        assert sample(node.manager, "gpuplugin_health_transitions_total", to="unhealthy") == len(hit)
        assert sample(node.manager, "gpuplugin_health_transitions_total", to="healthy") == 0
        assert 2 <= node.stream.count() <= 1 + len(hit)
        assert node.stream.latest() == {i: "Unhealthy" if i in hit else "Healthy" for i in node.ids}
        assert_no_flood(node)
        node.sim.allocate(RESOURCE, healthy)
    threads.assert_none_leaked()


def test_application_xids_change_nothing(plugin_dir: Path, threads: ThreadBaseline) -> None:
    stream = load_json(EVENTS / "app-xids.json")
    replay = stepped(stream, holds=[stream["end"]])
    with node_with_health(plugin_dir, replay, health_recovery=RECOVERY_S) as node:
        updates = node.sim.updates(RESOURCE)
        assert replay.wait_held()  # every Xid delivered and handled
        assert node.transitions() == 0
        assert node.stream.count() == 1  # the initial list, nothing after
        assert node.sim.updates(RESOURCE) == updates
        assert node.unhealthy() == set()
        node.sim.allocate(RESOURCE, node.ids)
    threads.assert_none_leaked()
