"""`gpuplugin run` as a real process against the kubelet simulator: registration, ListAndWatch, SIGTERM."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sim.kubelet import KubeletSimulator
from sim.ports import free_port
from tests.gpuplugin.deviceplugin.conftest import DGX_A100, RESOURCE
from tests.helpers.processes import http_ok, stop_process, wait_serving

WAIT = 20.0


def _gpuplugin(*args: str) -> list[str]:
    return [sys.executable, "-c", "from gpuplugin.cli import main; main()", *args]


def test_run_registers_serves_and_exits_cleanly_on_sigterm(plugin_dir: Path) -> None:
    with KubeletSimulator(plugin_dir) as sim:
        proc = subprocess.Popen(
            _gpuplugin(
                "run",
                "--topology",
                str(DGX_A100),
                "--device-plugin-dir",
                str(plugin_dir),
                "--metrics-port",
                "0",
                "--no-publish",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            devices = sim.wait_for_devices(RESOURCE, 8, WAIT)
            assert [d.id for d in devices] == [f"GPU{i}" for i in range(8)]
            assert {d.numa_nodes for d in devices} == {(1,), (3,), (5,), (7,)}
            assert sim.registrations(RESOURCE) == 1
            assert len(sim.preferred_raw(RESOURCE, [d.id for d in devices], [], 4)) == 4
            assert (plugin_dir / "gpu-topology.sock").exists()
        finally:
            _, err = stop_process(proc, WAIT)
        assert proc.returncode == 0, err
        assert not (plugin_dir / "gpu-topology.sock").exists()
        # The stream ended with the process: the kubelet marks the devices unhealthy.
        sim.wait_for_devices(RESOURCE, 0, WAIT)
    assert '"event": "plugin.publish.off", "reason": "--no-publish"' in err or (
        '"reason": "--no-publish"' in err and '"event": "plugin.publish.off"' in err)
    assert '"event": "plugin.process.stopping"' in err


def test_run_without_nvml_or_topology_exits_1_with_a_clear_message(plugin_dir: Path) -> None:
    done = subprocess.run(
        _gpuplugin("run", "--device-plugin-dir", str(plugin_dir), "--metrics-port", "0", "--no-publish"),
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert done.returncode == 1, done.stderr
    assert "NVML" in done.stderr and "--topology" in done.stderr


def test_without_nvml_and_no_fail_on_init_error_it_waits_healthy_advertising_nothing(plugin_dir: Path) -> None:
    """NVIDIA's failOnInitError=false: the pod stays up (no restart loop), advertises no GPUs, /healthz answers 200
    for the liveness probe, and a SIGTERM ends it cleanly."""
    port = free_port()
    with KubeletSimulator(plugin_dir) as sim:
        proc = subprocess.Popen(
            _gpuplugin("run", "--device-plugin-dir", str(plugin_dir), "--metrics-port", str(port), "--no-publish",
                       "--no-fail-on-init-error"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            wait_serving(proc, lambda: http_ok(f"http://127.0.0.1:{port}/healthz"), WAIT)
            assert sim.registrations(RESOURCE) == 0 and not (plugin_dir / "gpu-topology.sock").exists()
        finally:
            _, err = stop_process(proc, WAIT)
    assert proc.returncode == 0, err
    assert '"event": "plugin.nvml.unavailable"' in err
