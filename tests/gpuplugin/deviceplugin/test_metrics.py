"""/metrics and /healthz over real HTTP on 127.0.0.1."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from gpuplugin.deviceplugin.lifecycle import PluginRunner
from gpuplugin.deviceplugin.resource import ResourceManager
from gpuplugin.metrics import MetricsServer
from gputopo.core.topology import Topology
from sim.kubelet import KubeletSimulator
from tests.gpuplugin.deviceplugin.conftest import RESOURCE, RunnerFactory

WAIT = 10.0


@pytest.fixture
def served(start_plugin: RunnerFactory, dgx1: Topology) -> Iterator[tuple[PluginRunner, str]]:
    runner = start_plugin(ResourceManager(dgx1))
    server = MetricsServer(runner.metrics.registry, runner.ready, port=0, host="127.0.0.1").start()
    yield runner, f"http://127.0.0.1:{server.port}"
    server.stop()


def test_healthz_follows_registration(served: tuple[PluginRunner, str], plugin_dir: Path) -> None:
    runner, base = served
    assert httpx.get(f"{base}/healthz").status_code == 503  # serving, but no kubelet yet
    with KubeletSimulator(plugin_dir) as sim:
        sim.wait_for_devices(RESOURCE, 8, WAIT)
        assert runner.wait_registered(WAIT)
        assert httpx.get(f"{base}/healthz").status_code == 200
    # kubelet.sock is gone: no longer registered with a live kubelet.
    assert httpx.get(f"{base}/healthz").status_code == 503


def test_metrics_exposition(served: tuple[PluginRunner, str], plugin_dir: Path, dgx1: Topology) -> None:
    runner, base = served
    with KubeletSimulator(plugin_dir) as sim:
        sim.wait_for_devices(RESOURCE, 8, WAIT)
        sim.preferred_raw(RESOURCE, list(dgx1.ids), [], 4)
        sim.preferred_raw(RESOURCE, ["bogus"], [], 1)
        sim.allocate(RESOURCE, ["GPU0"])
        runner.manager.set_health(["GPU1"], healthy=False)
        sim.wait_for_devices(RESOURCE, 7, WAIT)
    text = httpx.get(f"{base}/metrics").text
    for line in (
        "gpuplugin_registrations_total 1.0",
        'gpuplugin_allocations_total{result="ok"} 1.0',
        'gpuplugin_preferred_fallbacks_total{reason="no_plan"} 1.0',
        'gpuplugin_preferred_fallbacks_total{reason="bad_request"} 1.0',
        "gpuplugin_preferred_allocation_seconds_count 2.0",
        'gpuplugin_health_transitions_total{to="unhealthy"} 1.0',
        'gpuplugin_devices{health="unhealthy"} 1.0',
        'gpuplugin_devices{health="healthy"} 7.0',
    ):
        assert line in text.splitlines(), line
    assert httpx.get(f"{base}/nope").status_code == 404
