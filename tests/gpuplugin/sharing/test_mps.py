"""The MPS daemon runner against a program that speaks the control pipe protocol (tests/helpers/mps_control.py):
started with its pipe and log directories, defaults applied, a dead daemon restarted with its replicas unhealthy
meanwhile; a plugin stop leaves the daemon to its clients and a restarted plugin adopts it (no second daemon); a
daemon that lives but is silent is waited for, never doubled; a pid file naming some other process does not count
as a daemon; `quit` only when asked."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from gpuplugin.sharing.mps import PID_FILE, MpsDaemon, MpsGpu, MpsShare
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
            pid = int((share.pipe_dir / PID_FILE).read_text())
            os.kill(pid, signal.SIGKILL)  # the daemon dies
            assert eventually(lambda: seen == [False, True, False, True])
            assert daemon.starts == 2
            assert int((share.pipe_dir / PID_FILE).read_text()) != pid
        finally:
            daemon.stop()
        assert daemon.answers()  # a plugin stop leaves the daemon to the pods holding its replicas
        daemon.quit()
        assert not daemon.answers()
        assert not (share.pipe_dir / PID_FILE).exists() and (share.pipe_dir / "control").exists()  # as the real one


def _pid(share: MpsShare) -> int:
    return int((share.pipe_dir / PID_FILE).read_text())


def test_a_restarted_plugin_adopts_the_running_daemon() -> None:
    with short_dir("mps-") as root:
        share = MpsShare("nvidia.com/gpu", root, (MpsGpu("GPU-a", 4, 8000),))
        first = MpsDaemon(share, lambda ok: None, command=FAKE)
        first.step()
        pid = _pid(share)
        first.stop()  # the plugin exits
        # the restarted plugin's config now cuts the GPU in 2: the adopted daemon gets the new defaults
        share2 = MpsShare("nvidia.com/gpu", root, (MpsGpu("GPU-a", 2, 8000),))
        seen: list[bool] = []
        second = MpsDaemon(share2, seen.append, command=FAKE)
        try:
            second.step()
            assert second.adopted and second.starts == 0 and seen == [True]  # never unhealthy, no second start
            assert _pid(share2) == pid and second.state is not None and second.state.alive
            assert second.send("get_default_active_thread_percentage") == "50.0"
            second.step()
            assert _pid(share2) == pid and second.starts == 0
        finally:
            second.stop(retire=True)  # the set is gone: now it quits
        assert not second.answers()


def test_a_silent_daemon_that_lives_is_waited_for_not_doubled() -> None:
    with short_dir("mps-") as root:
        share = MpsShare("nvidia.com/gpu", root, (MpsGpu("GPU-a", 2, None),))
        first = MpsDaemon(share, lambda ok: None, command=FAKE)
        first.step()
        pid = _pid(share)
        os.kill(pid, signal.SIGSTOP)  # alive, holding its lock, answering nothing
        try:
            seen: list[bool] = []
            second = MpsDaemon(share, seen.append, command=FAKE, backoff_initial_s=0.01)
            second.step()
            assert seen == [False] and second.starts == 0 and second.state is not None and second.state.alive
        finally:
            os.kill(pid, signal.SIGCONT)
        second.step()
        assert seen == [False, True] and second.starts == 0 and _pid(share) == pid
        second.quit()


def test_a_pid_file_naming_another_process_is_not_a_daemon() -> None:
    with short_dir("mps-") as root:
        share = MpsShare("nvidia.com/gpu", root, (MpsGpu("GPU-a", 2, None),))
        share.pipe_dir.mkdir(parents=True)
        (share.pipe_dir / PID_FILE).write_text(str(os.getpid()))  # left by a daemon long gone; the pid reused
        daemon = MpsDaemon(share, lambda ok: None, command=FAKE)
        try:
            daemon.step()
            assert daemon.starts == 1 and daemon.healthy and _pid(share) != os.getpid()
        finally:
            daemon.quit()


def test_a_command_that_cannot_start_keeps_the_replicas_unhealthy() -> None:
    with short_dir("mps-") as root:
        share = MpsShare("nvidia.com/gpu", root, (MpsGpu("GPU-a", 2, None),))
        seen: list[bool] = []
        daemon = MpsDaemon(share, seen.append, command=[str(Path(root) / "no-such-program")], interval_s=0.05,
                           backoff_initial_s=0.05, backoff_max_s=0.1)
        assert daemon.step() <= 0.1
        assert seen == [False] and daemon.starts == 0


def test_the_daemon_defaults_are_the_most_one_container_may_hold() -> None:
    """A client's environment lowers the daemon's defaults and cannot raise them (bench.mps_limits on the H200), so
    where a container may hold several replicas of one GPU the defaults must not cap it at one replica."""
    gpus = (MpsGpu("GPU-a", 4, 8000), MpsGpu("GPU-b", 2, 8000))
    one = MpsShare("nvidia.com/gpu", Path("/run/mps"), gpus)
    # one thread percentage for the whole daemon: the largest share, so one replica of GPU-b gets its 50%
    assert one.default_commands() == ["set_default_active_thread_percentage 50",
                                      "set_default_device_pinned_mem_limit 0 2000M",
                                      "set_default_device_pinned_mem_limit 1 4000M"]
    several = MpsShare("nvidia.com/gpu", Path("/run/mps"), gpus, several_per_client=True)
    assert several.default_commands() == ["set_default_active_thread_percentage 100",
                                          "set_default_device_pinned_mem_limit 0 8000M",
                                          "set_default_device_pinned_mem_limit 1 8000M"]
    env, _ = several.client([("GPU-a", 3)])  # the container's own share is still in its environment
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "75" and env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=6000M"
