"""Fault scenarios around the device plugin's life, each ending with the state checked: what the kubelet lists,
health, registration counts, which sockets exist, and that no thread is left behind.

tests/gpuplugin/deviceplugin covers the happy path of each recovery (re-registration after a restart, registering late,
serving a deleted socket again); these add what happens to an open stream, repeated and stacked faults, refusals, health
changes while the kubelet is away, and a plugin restart while pods hold GPUs (state rebuilt from PodResources).

A kubelet restart is answered with exactly one registration (the plugin decides on the directory's state, not on
events; tests/reliability/test_kubelet_restarts.py drives hundreds of them), and the plugin's own count must equal
the kubelet's.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuplugin.config import PluginConfig
from gpuplugin.deviceplugin.lifecycle import PluginRunner
from gpuplugin.deviceplugin.resource import ResourceManager
from gpuplugin.proto import deviceplugin_pb2 as pb
from gpuplugin.publisher import start_publisher
from gputopo.core.codec import state_from_json
from gputopo.core.topology import Topology
from gputopo.discovery.loader import load_topology_file
from gputopo.kube import make_api_client
from sim import kubelet as kubelet_sim
from sim.kubelet import KubeletSimulator
from tests.fakes.kubeapi import FakeKubeApi
from tests.fakes.kubelet_podresources import FakePodResources
from tests.fixtures.nvml import HGX
from tests.gpuplugin.deviceplugin.conftest import DGX1, RESOURCE, sample
from tests.gpuplugin.publisher.conftest import NODE, node_object
from tests.helpers.paths import short_dir
from tests.helpers.polling import eventually
from tests.reliability.conftest import (
    SOCKET_NAME,
    WAIT,
    RawStream,
    ThreadBaseline,
    is_socket,
    options_call,
    podresources_server,
    running_plugin,
    sockets_in,
    stale_socket,
)

BOTH_SOCKETS = sorted([SOCKET_NAME, "kubelet.sock"])


@pytest.fixture(scope="module")
def dgx1() -> Topology:
    return load_topology_file(DGX1)


@pytest.fixture(scope="module")
def hgx() -> Topology:
    return load_topology_file(HGX)


def admit(sim: KubeletSimulator, size: int, held: frozenset[str] = frozenset()) -> list[str]:
    """What the kubelet does for a pod: candidates = its healthy devices minus those it holds, ask the plugin for a
    preference, allocate it. Checks the answer names exactly the devices asked for."""
    free = [d.id for d in sim.devices(RESOURCE) if d.healthy and d.id not in held]
    ids = sim.preferred(RESOURCE, free, [], size)
    assert len(ids) == size and set(ids) <= set(free)
    resp = sim.allocate(RESOURCE, ids)
    assert sorted(resp.envs["NVIDIA_VISIBLE_DEVICES"].split(",")) == sorted(ids)
    assert sorted(resp.annotations["gpu-topology.io/gpus"].split(",")) == sorted(ids)
    return ids


def assert_settled(
    sim: KubeletSimulator,
    runner: PluginRunner,
    topo: Topology,
    plugin_dir: Path,
    by_others: int = 0,
    unanswered: int = 0,
) -> None:
    """The state every recovery must end in: registered with the kubelet now serving, both sockets present, the
    kubelet holding the complete healthy list, the kubelet counting exactly the plugin's registrations, plus
    `by_others` made by an earlier plugin process, plus at most `unanswered`: registrations a kubelet accepted
    but died before answering (the plugin rightly counts those as failed and registers again)."""
    devices = sim.wait_for_devices(RESOURCE, topo.size, WAIT)
    assert [d.id for d in devices] == list(topo.ids)
    assert eventually(runner.ready, interval=0.02), "plugin not registered with the current kubelet"

    def extra() -> int:
        return sim.registrations(RESOURCE) - runner.registrations - by_others

    assert eventually(lambda: 0 <= extra() <= unanswered, interval=0.02), (
        f"kubelet counted {extra()} more registrations")
    assert sockets_in(plugin_dir) == BOTH_SOCKETS


def test_kubelet_restart_mid_stream_ends_it_and_a_new_stream_delivers_everything(
    plugin_dir: Path, dgx1: Topology, threads: ThreadBaseline
) -> None:
    manager = ResourceManager(dgx1)
    with KubeletSimulator(plugin_dir) as sim, running_plugin(manager, plugin_dir) as runner:
        sim.wait_for_devices(RESOURCE, 8, WAIT)
        with RawStream(plugin_dir) as old:
            assert old.wait_for(lambda m: len(m) == 1)
            sim.restart()  # every socket deleted (ours too), then a new kubelet.sock
            assert old.ended.wait(WAIT), "the stream on the deleted socket stayed open"
            assert old.count() == 1
        assert_settled(sim, runner, dgx1, plugin_dir)
        assert sim.registrations(RESOURCE) == 2
        assert sample(manager, "gpuplugin_server_starts_total") == 2  # our socket was deleted once
        with RawStream(plugin_dir) as fresh:
            assert fresh.wait_for(lambda m: len(m) >= 1)
            assert fresh.latest() == dict.fromkeys(dgx1.ids, "Healthy")
        first = admit(sim, 4)
        admit(sim, 4, held=frozenset(first))
    assert not (plugin_dir / SOCKET_NAME).exists()
    threads.assert_none_leaked()


@pytest.mark.parametrize("before", ["absent", "dead-socket"])
def test_plugin_serves_without_a_kubelet_and_registers_once_one_appears(
    plugin_dir: Path, dgx1: Topology, threads: ThreadBaseline, before: str
) -> None:
    if before == "dead-socket":  # a crashed kubelet's socket file: connecting is refused
        stale_socket(plugin_dir / "kubelet.sock")
    manager = ResourceManager(dgx1)
    with running_plugin(manager, plugin_dir) as runner:
        # Serving meanwhile: a kubelet dialling in now would get options and the complete list.
        assert options_call(plugin_dir).get_preferred_allocation_available
        with RawStream(plugin_dir) as stream:
            assert stream.wait_for(lambda m: len(m) >= 1)
            assert stream.latest() == dict.fromkeys(dgx1.ids, "Healthy")
        if before == "dead-socket":
            assert runner.wait_until(lambda r: r.registration_failures >= 2, WAIT)  # retried with backoff
        else:
            assert runner.registration_failures == 0  # nothing to register with: no attempt
        assert not runner.registered and not runner.ready()
        with KubeletSimulator(plugin_dir) as sim:
            assert_settled(sim, runner, dgx1, plugin_dir)
            assert sim.registrations(RESOURCE) == 1
            admit(sim, 2)
        # The kubelet went away again: still serving, no longer ready.
        assert eventually(lambda: not runner.ready(), interval=0.02)
        assert runner.serving
        assert options_call(plugin_dir).get_preferred_allocation_available
    assert sockets_in(plugin_dir) == []
    threads.assert_none_leaked()


@pytest.mark.parametrize(("fault", "times"), [("deleted", 1), ("deleted", 3), ("replaced-by-file", 1)])
def test_our_socket_removed_under_the_running_plugin_is_served_and_registered_again(
    plugin_dir: Path, dgx1: Topology, threads: ThreadBaseline, fault: str, times: int
) -> None:
    manager = ResourceManager(dgx1)
    ours = plugin_dir / SOCKET_NAME
    with KubeletSimulator(plugin_dir) as sim, running_plugin(manager, plugin_dir) as runner:
        sim.wait_for_devices(RESOURCE, 8, WAIT)
        with RawStream(plugin_dir) as old:
            assert old.wait_for(lambda m: len(m) == 1)
            for k in range(times):
                os.unlink(ours)
                if fault == "replaced-by-file":
                    ours.write_text("not a socket")
                sim.wait_for_registrations(RESOURCE, k + 2, WAIT)
                assert eventually(lambda: is_socket(ours), interval=0.02)
                sim.wait_for_devices(RESOURCE, 8, WAIT)
                # one fault at a time: the next comes once the plugin holds this registration's answer (a deletion
                # while its Register is still out is a different fault, tested in test_kubelet_restarts.py)
                assert eventually(lambda k=k: runner.ready() and runner.registrations == k + 2, interval=0.02)
            assert old.ended.wait(WAIT), "a stream of the old server stayed open"
        assert_settled(sim, runner, dgx1, plugin_dir)
        assert sim.registrations(RESOURCE) == 1 + times  # the kubelet did not restart: exactly one per fault
        assert sample(manager, "gpuplugin_server_starts_total") == 1 + times
        assert sim.rejections == []
        admit(sim, 8)
    assert not ours.exists()
    threads.assert_none_leaked()


def test_two_kubelet_restarts_in_quick_succession(plugin_dir: Path, dgx1: Topology, threads: ThreadBaseline) -> None:
    manager = ResourceManager(dgx1)
    with KubeletSimulator(plugin_dir) as sim, running_plugin(manager, plugin_dir) as runner:
        sim.wait_for_devices(RESOURCE, 8, WAIT)
        sim.restart()
        sim.restart()  # before the plugin had time to settle with the first
        # A registration in flight when the second restart hits can be accepted and never answered.
        assert_settled(sim, runner, dgx1, plugin_dir, unanswered=1)
        assert 2 <= runner.registrations <= 4
        # The stream the current kubelet holds is live: a health change reaches it.
        assert manager.set_health(["GPU3"], healthy=False) == ["GPU3"]
        devices = sim.wait_for_devices(RESOURCE, 7, WAIT)
        assert [d.id for d in devices if not d.healthy] == ["GPU3"]
        assert "GPU3" not in admit(sim, 7)
    threads.assert_none_leaked()


class RefusingKubelet(KubeletSimulator):
    """The simulated kubelet, refusing the first `refusals` registrations (as a kubelet still starting up does)."""

    def __init__(self, plugin_dir: Path, refusals: int) -> None:
        super().__init__(plugin_dir)
        self.refusals_left = refusals

    def _register(self, request: pb.RegisterRequest, life: kubelet_sim._Life) -> None:
        with self._cond:
            refuse = self.refusals_left > 0
            self.refusals_left -= refuse
        if refuse:
            raise kubelet_sim._Refused("device manager not ready (injected)")
        super()._register(request, life)


@pytest.mark.parametrize("refusals", [1, 3])
def test_a_kubelet_that_refuses_then_accepts(
    plugin_dir: Path, dgx1: Topology, threads: ThreadBaseline, refusals: int
) -> None:
    manager = ResourceManager(dgx1)
    with RefusingKubelet(plugin_dir, refusals) as sim, running_plugin(manager, plugin_dir) as runner:
        assert_settled(sim, runner, dgx1, plugin_dir)
        # kubelet.sock existed before the plugin started, so no inotify event adds attempts: the counts are exact.
        assert runner.registration_failures == refusals
        assert sample(manager, "gpuplugin_registration_failures_total") == refusals
        assert sim.rejections == ["device manager not ready (injected)"] * refusals
        assert sim.registrations(RESOURCE) == 1 and runner.registrations == 1
        admit(sim, 3)
    threads.assert_none_leaked()


def test_health_changed_while_the_kubelet_was_down_reaches_the_next_kubelet(
    plugin_dir: Path, dgx1: Topology, threads: ThreadBaseline
) -> None:
    manager = ResourceManager(dgx1)
    with running_plugin(manager, plugin_dir) as runner:
        sim = KubeletSimulator(plugin_dir).start()
        try:
            sim.wait_for_devices(RESOURCE, 8, WAIT)
            sim.stop()  # kubelet down; it leaves our socket alone
            assert manager.set_health(["GPU2", "GPU6"], healthy=False) == ["GPU2", "GPU6"]
            assert manager.set_health(["GPU6"], healthy=True) == ["GPU6"]
            sim.start()
            devices = sim.wait_until(RESOURCE, lambda ds: [d.id for d in ds if not d.healthy] == ["GPU2"], WAIT)
            assert len(devices) == 8
            assert eventually(runner.ready, interval=0.02)
            assert sim.registrations(RESOURCE) == 2
            assert sample(manager, "gpuplugin_server_starts_total") == 1  # our socket was never touched
        finally:
            sim.stop()
    threads.assert_none_leaked()


# ---- a plugin restart while pods hold GPUs ----------------------------------------------------------------------

FAST_PUBLISHER = {"poll_interval_s": 0.1, "min_interval_s": 0.0, "backoff_initial_s": 0.01, "backoff_max_s": 0.1}


@pytest.fixture
def podres_dir() -> Iterator[Path]:
    with short_dir("rel-podres-") as path:
        yield path


class Pods:
    """The kubelet's record of which pod holds which GPUs, served through the PodResources fake."""

    def __init__(self, service: FakePodResources) -> None:
        self.service = service
        self.held: dict[str, list[str]] = {}

    def start(self, sim: KubeletSimulator, name: str, size: int) -> list[str]:
        ids = admit(sim, size, self.used())
        self.held[name] = ids
        self.service.set_pod("ml", name, {"main": {RESOURCE: ids}})
        return ids

    def end(self, name: str) -> None:
        del self.held[name]
        self.service.remove_pod("ml", name)

    def used(self) -> frozenset[str]:
        return frozenset(i for ids in self.held.values() for i in ids)


def test_plugin_restart_republishes_what_podresources_holds_not_what_it_remembered(
    plugin_dir: Path, podres_dir: Path, hgx: Topology, threads: ThreadBaseline
) -> None:
    """The FakeKubeApi Node is the check: its state annotation must name exactly the GPUs the kubelet's PodResources
    reports after the restart (a pod ended while the plugin was down), and a pod admitted afterwards must not get
    a GPU someone holds."""
    cfg = PluginConfig(
        device_plugin_dir=plugin_dir, node_name=NODE, pod_resources_socket=podres_dir / "kubelet.sock", metrics_port=0
    )
    key = "gpu-topology.io/state"
    with (
        FakeKubeApi() as fake,
        podresources_server(podres_dir / "kubelet.sock") as podresources,
        KubeletSimulator(plugin_dir) as sim,
    ):
        fake.add_node(node_object())
        api = make_api_client(host=fake.url, timeout_s=5.0)
        pods = Pods(podresources)

        def node_state() -> object:
            return state_from_json((fake.node(NODE) or {})["metadata"]["annotations"][key])

        try:
            first = ResourceManager(hgx)
            with running_plugin(first, plugin_dir):
                publication = start_publisher(cfg, first, api=api, **FAST_PUBLISHER)
                assert publication is not None
                try:
                    sim.wait_for_devices(RESOURCE, 8, WAIT)
                    train = pods.start(sim, "train", 4)
                    infer = pods.start(sim, "infer", 2)
                    assert publication.publisher.wait_for_state(lambda s: s.used == set(train + infer), WAIT)
                finally:
                    publication.stop()
            generation = node_state().generation
            stale_socket(plugin_dir / SOCKET_NAME)  # a killed plugin leaves its socket behind
            # While the plugin is down: the kubelet sees the stream end, and the training pod finishes.
            sim.wait_until(RESOURCE, lambda ds: len(ds) == 8 and not any(d.healthy for d in ds), WAIT)
            pods.end("train")
            assert node_state().used == set(train + infer)  # the Node still carries the old truth

            second = ResourceManager(hgx)  # a new process: nothing remembered
            with running_plugin(second, plugin_dir) as runner:
                publication = start_publisher(cfg, second, api=api, **FAST_PUBLISHER)
                assert publication is not None
                try:
                    assert_settled(sim, runner, hgx, plugin_dir, by_others=1)
                    assert publication.publisher.wait_for_state(lambda s: s.used == set(infer), WAIT)
                    state = node_state()
                    assert (state.used, state.unhealthy) == (set(infer), frozenset())
                    assert state.generation == generation + 1  # continues from what the Node carried
                    big = pods.start(sim, "big", 6)
                    assert not set(big) & set(infer)  # no GPU assigned twice
                    assert publication.publisher.wait_for_state(lambda s: s.used == set(infer + big), WAIT)
                    assert node_state().used == set(infer + big) == set(hgx.ids)
                finally:
                    publication.stop()
        finally:
            api.close()
    assert not (plugin_dir / SOCKET_NAME).exists()
    threads.assert_none_leaked()
