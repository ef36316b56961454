"""`gpuplugin run --mps-daemons external` and `gpuplugin mps-control` as two real processes sharing an MPS root,
with the control-protocol stand-in (tests/helpers/mps_control.py) as the control program, the kubelet simulator
and PodResources: the plugin killed and started again while a pod holds MPS replicas finds the same daemon (no
restart) and its replicas healthy again; a daemon killed is started again by the control process, and while
no daemon answers the plugin keeps its replicas unhealthy; a set the plugin takes out is quit; a garbled desired
file is refused with a clear error and the last good state kept (and /healthz, /metrics say so)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gputopo.contract import replica_id
from tests.fakes.gpunode import gpu_node
from tests.helpers.paths import REPO, SHARED, short_dir
from tests.helpers.polling import eventually
from tests.helpers.processes import http_ok, stop_process, wait_serving

NODE = "dgx1-node"
SHARED_GPU = "nvidia.com/gpu.shared"
DGX1 = SHARED / "topologies" / "dgx1-v100-ucxpy.txt"
WAIT = 30.0
MPS = "version: v1\nsharing:\n  mps:\n    renameByDefault: true\n    resources:\n" \
      "    - {name: nvidia.com/gpu, replicas: 2, devices: [0, 1]}\n"


def _control_program(directory: Path) -> Path:
    """One executable (the settings take one program name) that runs the stand-in; its name is the stand-in's, as
    the daemon's command line shows it (the probes check that the pid file names the control program)."""
    program = directory / "mps_control.py"
    program.write_text(f'#!/bin/sh\nexec {sys.executable} {REPO / "tests" / "helpers" / "mps_control.py"} "$@"\n')
    program.chmod(0o755)
    return program


@contextmanager
def _keeper(root: Path, program: Path, log: Path, metrics_port: int = 0) -> Iterator[subprocess.Popen[bytes]]:
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "gpuplugin.cli", "mps-control", "--mps-root", str(root), "--mps-control",
             str(program), "--poll-interval", "0.2", "--probe-interval", "0.2", "--metrics-port", str(metrics_port)],
            stdout=out, stderr=subprocess.STDOUT)
    try:
        yield process
    finally:
        stop_process(process)


def _pid(root: Path) -> int | None:
    try:
        return int((root / SHARED_GPU / "pipe" / "nvidia-cuda-mps-control.pid").read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


def _quit(root: Path, program: Path) -> None:
    subprocess.run([str(program)], input="quit\n", text=True, timeout=10, check=False, capture_output=True,
                   env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(root / SHARED_GPU / "pipe")})


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def _plugin_args(configs: Path, root: Path, program: Path) -> list[str]:
    return ["--sharing-config-dir", str(configs), "--sharing-config-default", "mps", "--sharing-poll-interval",
            "0.2", "--mps-root", str(root), "--mps-control", str(program), "--mps-daemons", "external",
            "--mps-probe-interval", "0.2", "--device-id-strategy", "index"]


def test_a_plugin_restart_leaves_the_daemon_and_its_clients(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "mps").write_text(MPS)
    program = _control_program(tmp_path)
    keeper_log = tmp_path / "keeper.log"
    with short_dir("mpsr-") as root:
        try:
            with gpu_node(NODE, DGX1, args=_plugin_args(configs, root, program)) as node:
                kubelet = node.kubelet
                with _keeper(root, program, keeper_log):
                    kubelet.wait_for_devices(SHARED_GPU, 4, WAIT)  # healthy: the control process's daemon answers
                    pid = _pid(root)
                    assert _alive(pid), keeper_log.read_text()
                    held = [replica_id("0", 0)]
                    kubelet.allocate(SHARED_GPU, held)
                    node.podres.service.set_pod("default", "infer", {"main": {SHARED_GPU: held}})

                    node.kill()  # the plugin's container ends: the daemon is not in it
                    kubelet.wait_until(SHARED_GPU, lambda ds: not any(d.healthy for d in ds), WAIT)
                    assert _alive(pid) and _pid(root) == pid
                    node.start_again()
                    kubelet.wait_for_devices(SHARED_GPU, 4, WAIT)
                    assert _pid(root) == pid and _alive(pid), node.log_tail()
                    assert keeper_log.read_text().count("plugin.mps.started") == 1  # started once, never again

                    os.kill(pid or 0, signal.SIGKILL)  # the daemon dies: the control process starts it again
                    assert eventually(lambda: _alive(_pid(root)) and _pid(root) != pid, WAIT), keeper_log.read_text()
                    kubelet.wait_for_devices(SHARED_GPU, 4, WAIT)
                    pid = _pid(root)
                # the control process stopped: the daemon runs on, and now nobody starts it when it dies
                assert _alive(pid)
                os.kill(pid or 0, signal.SIGKILL)
                kubelet.wait_until(SHARED_GPU, lambda ds: len(ds) == 4 and not any(d.healthy for d in ds), WAIT)
                with _keeper(root, program, keeper_log):
                    kubelet.wait_for_devices(SHARED_GPU, 4, WAIT)  # healthy once its new daemon answers
                    assert _alive(_pid(root)) and _pid(root) != pid

                    (configs / "mps").write_text("version: v1\n")  # the plugin takes the set out (no pod holds it)
                    node.podres.service.remove_pod("default", "infer")
                    kubelet.wait_for_devices("nvidia.com/gpu", 8, WAIT)
                    assert eventually(lambda: _pid(root) is None, WAIT), keeper_log.read_text()  # quit
        finally:
            _quit(root, program)


def test_a_garbled_desired_file_is_refused_and_the_last_good_state_kept(tmp_path: Path) -> None:
    from gpuplugin.sharing.desired import DesiredSet, desired_path, write_desired
    from gpuplugin.sharing.mps import MpsGpu, MpsShare

    program = _control_program(tmp_path)
    log = tmp_path / "keeper.log"
    with short_dir("mpsr-") as root:
        try:
            write_desired(root, [DesiredSet(MpsShare(SHARED_GPU, root, (MpsGpu("GPU-a", 2, None),)), 1)])
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            with _keeper(root, program, log, port) as keeper:
                assert eventually(lambda: _alive(_pid(root)), WAIT), log.read_text()
                wait_serving(keeper, lambda: http_ok(f"http://127.0.0.1:{port}/healthz"), WAIT, log)
                answering = f'gpuplugin_mps_daemon_answering{{resource="{SHARED_GPU}"}} 1.0'
                assert eventually(lambda: answering in _metrics(port), WAIT)
                pid = _pid(root)
                desired_path(root).write_text('{"version": 1, "sets": [{"resource": "nvidia.com/gpu.shared", '
                                              '"generation": 1, "pipe_dir": "/etc", "log_dir": "/etc", '
                                              '"gpus": [{"uuid": "GPU-a", "replicas": 2}]}]}')
                # refused naming the field (a read halfway through the write may be refused as not JSON first)
                assert eventually(lambda: "plugin.mps_desired.refused" in log.read_text()
                                  and "pipe_dir '/etc'" in log.read_text(), WAIT), log.read_text()
                os.kill(pid or 0, signal.SIGKILL)  # the last good state is still kept: started again
                assert eventually(lambda: _alive(_pid(root)) and _pid(root) != pid, WAIT), log.read_text()
        finally:
            _quit(root, program)
