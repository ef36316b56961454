"""The MPS daemon runner against a program that speaks the control pipe protocol (tests/helpers/mps_control.py):
started with its pipe and log directories, defaults applied, a dead daemon restarted with its replicas unhealthy
meanwhile, and quit at stop."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from gpuplugin.sharing.mps import MpsDaemon, MpsGpu, MpsShare
from tests.helpers.paths import REPO, short_dir
from tests.helpers.polling import eventually

FAKE = [sys.executable, str(REPO / "tests" / "helpers" / "mps_control.py")]


def test_daemon_is_started_restarted_and_quit() -> None:
    with short_dir("mps-") as root:
        share = MpsShare("nvidia.com/gpu", root, (MpsGpu("GPU-a", 4, 8000), MpsGpu("GPU-b", 4, None)))
        seen: list[bool] = []
        daemon = MpsDaemon(share, seen.append, command=FAKE, interval_s=0.05, backoff_initial_s=0.05,
                           backoff_max_s=0.2).start()
        try:
            assert eventually(lambda: seen[-1:] == [True])
            assert seen == [False, True]  # unhealthy until it answered
            assert daemon.send("get_default_active_thread_percentage") == "25.0"
            assert daemon.send("get_default_device_pinned_mem_limit 0") == "2000M"
            assert (root / "nvidia.com/gpu" / "log").is_dir()
            pid = int((share.pipe_dir / "fake.pid").read_text())
            os.kill(pid, signal.SIGKILL)  # the daemon dies
            assert eventually(lambda: seen == [False, True, False, True])
            assert daemon.starts == 2
            assert int((share.pipe_dir / "fake.pid").read_text()) != pid
        finally:
            daemon.stop()
        assert not daemon.answers()  # quit at stop


def test_a_command_that_cannot_start_keeps_the_replicas_unhealthy() -> None:
    with short_dir("mps-") as root:
        share = MpsShare("nvidia.com/gpu", root, (MpsGpu("GPU-a", 2, None),))
        seen: list[bool] = []
        daemon = MpsDaemon(share, seen.append, command=[str(Path(root) / "no-such-program")], interval_s=0.05,
                           backoff_initial_s=0.05, backoff_max_s=0.1)
        assert daemon.step() <= 0.1
        assert seen == [False] and daemon.starts == 0
