"""SIGTERM ends the plugin's commands whichever of the process's threads the kernel hands it to.

CPython runs a signal handler in the main thread, when that thread next runs Python code. A signal handed to
another thread (gRPC's, watchdog's: the kernel may pick any thread of the process) used to leave the main thread
blocked in `stop.wait()` for good: `gpuplugin run` ignored SIGTERM until SIGKILL (bench.plugin hung on one plugin
stop in ten). On Linux, kill() with a thread's id hands the signal to that thread, which makes the case certain."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from gputopo.workers import stop_on_signals
from sim.kubelet import KubeletSimulator
from tests.gpuplugin.deviceplugin.conftest import DGX_A100, RESOURCE
from tests.helpers.processes import stop_process

WAIT = 20.0


def test_the_stop_event_is_set_by_a_signal_that_lands_on_another_thread() -> None:
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stop = stop_on_signals("test")

    def elsewhere() -> None:
        time.sleep(0.1)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # to this thread, not the main one

    try:
        threading.Thread(target=elsewhere, name="elsewhere").start()
        t0 = time.monotonic()
        assert stop.wait(10)  # a plain Event.wait(10) returns False after 10 s, the handler not run meanwhile
        assert time.monotonic() - t0 < 5
        assert stop.is_set()
    finally:
        signal.signal(signal.SIGTERM, handlers[0])
        signal.signal(signal.SIGINT, handlers[1])


def handed_to_another_thread(pid: int) -> bool:
    """SIGTERM to one of the process's threads other than the main one (Linux: kill() with a thread's id hands
    the signal to that thread), gRPC's timer thread first: it lives as long as the process, where a short-lived
    thread may be gone before the signal is sent."""
    def name(tid: int) -> str:
        try:
            return Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        except OSError:  # that thread ended meanwhile
            return ""

    others = sorted((int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid),
                    key=lambda t: name(t) != "grpc_global_tim")
    for tid in others:
        try:
            os.kill(tid, signal.SIGTERM)
            return True
        except ProcessLookupError:  # that thread ended meanwhile
            continue
    return False


def test_run_exits_cleanly_on_a_sigterm_handed_to_one_of_its_other_threads(plugin_dir: Path) -> None:
    with KubeletSimulator(plugin_dir) as sim:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from gpuplugin.cli import main; main()", "run", "--topology", str(DGX_A100),
             "--device-plugin-dir", str(plugin_dir), "--metrics-port", "0", "--no-publish"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        try:
            sim.wait_for_devices(RESOURCE, 8, WAIT)
            assert handed_to_another_thread(proc.pid), "the plugin runs threads besides its main one"
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                raise AssertionError("gpuplugin run ignored a SIGTERM handed to another thread") from None
        finally:
            _, err = stop_process(proc, WAIT)
    assert proc.returncode == 0, err
    assert '"event": "worker.signal.received"' in err and '"signal": "SIGTERM"' in err
    assert '"event": "plugin.process.stopping"' in err
