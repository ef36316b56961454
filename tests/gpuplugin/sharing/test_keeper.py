"""The MPS control daemon set's loop against the control-protocol stand-in (tests/helpers/mps_control.py), driven by
the desired-state file: a wanted set gets one daemon, a killed one is started again, a set taken out quits, a new
generation restarts it, new defaults of the same generation do not, a stopped keeper leaves its daemons and the
next adopts them, and a garbled file keeps the last good state."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from gpuplugin.sharing.desired import DesiredSet, desired_path, write_desired
from gpuplugin.sharing.keeper import MpsKeeper
from gpuplugin.sharing.mps import PID_FILE, MpsDaemon, MpsGpu, MpsShare
from tests.helpers.paths import REPO, short_dir
from tests.helpers.polling import eventually

FAKE = (sys.executable, str(REPO / "tests" / "helpers" / "mps_control.py"))
GPU = "nvidia.com/gpu"


def _keeper(root: Path) -> MpsKeeper:
    return MpsKeeper(root, command=FAKE, poll_interval_s=0.05, daemon_interval_s=0.05, backoff_initial_s=0.05,
                     backoff_max_s=0.2)


def _share(root: Path, replicas: int = 4) -> MpsShare:
    return MpsShare(GPU, root, (MpsGpu("GPU-a", replicas, 8000),))


def _pid(root: Path) -> int | None:
    try:
        return int((root / GPU / "pipe" / PID_FILE).read_text())
    except (OSError, ValueError):
        return None


def _ask(root: Path, line: str) -> str | None:
    try:
        return MpsDaemon(_share(root), lambda ok: None, command=FAKE).send(line)
    except Exception:
        return None


def _left_by_a_stopped_keeper(root: Path) -> int | None:
    """One set wanted, its daemon started by a keeper that then stopped (a keeper pod restart): the daemon's pid."""
    write_desired(root, [DesiredSet(_share(root), 1)])
    first = _keeper(root).start()
    try:
        assert eventually(lambda: _ask(root, "get_server_list") is not None)
        return _pid(root)
    finally:
        first.stop()


def test_wanted_sets_are_kept_restarted_updated_and_quit() -> None:
    with short_dir("keep-") as root:
        keeper = _keeper(root).start()
        try:
            assert keeper.pause(0.2) is False and _pid(root) is None  # no file: nothing decided, nothing started
            write_desired(root, [DesiredSet(_share(root), 1)])
            assert eventually(lambda: _ask(root, "get_server_list") is not None)
            first = _pid(root)
            # the defaults follow the start by one command: a probe can answer in between
            assert eventually(lambda: _ask(root, "get_default_active_thread_percentage") == "25.0")
            os.kill(first or 0, signal.SIGKILL)  # the daemon dies: started again
            assert eventually(lambda: _pid(root) not in (None, first) and _ask(root, "get_server_list") is not None)
            second = _pid(root)
            write_desired(root, [DesiredSet(_share(root, replicas=2), 1)])  # same generation: new defaults only
            assert eventually(lambda: _ask(root, "get_default_active_thread_percentage") == "50.0")
            assert _pid(root) == second
            write_desired(root, [DesiredSet(_share(root, replicas=2), 2)])  # replaced by the plugin: restarted
            assert eventually(lambda: _pid(root) not in (None, second) and _ask(root, "get_server_list") is not None)
            third = _pid(root)
            write_desired(root, [DesiredSet(_share(root), 1)])  # lower: a plugin counting again, not a replacement
            assert eventually(lambda: _ask(root, "get_default_active_thread_percentage") == "25.0")
            assert _pid(root) == third
            write_desired(root, [DesiredSet(_share(root), 2)])  # higher than the one kept now: replaced
            assert eventually(lambda: _pid(root) not in (None, third) and _ask(root, "get_server_list") is not None)
            write_desired(root, [])  # taken out by the plugin: quit
            assert eventually(lambda: _pid(root) is None and _ask(root, "get_server_list") is None)
        finally:
            keeper.stop()
            _ask(root, "quit")


def test_a_stopped_keeper_leaves_its_daemons_and_the_next_adopts_them() -> None:
    with short_dir("keep-") as root:
        pid = _left_by_a_stopped_keeper(root)
        assert _pid(root) == pid and _ask(root, "get_server_list") is not None
        second = _keeper(root)
        try:
            second.step()
            (_, daemon), = second.kept.values()
            assert eventually(lambda: daemon.adopted)
            assert daemon.starts == 0 and _pid(root) == pid
        finally:
            second.stop()
            _ask(root, "quit")


def test_a_garbled_file_keeps_the_last_good_state() -> None:
    with short_dir("keep-") as root:
        write_desired(root, [DesiredSet(_share(root), 1)])
        keeper = _keeper(root).start()
        try:
            assert eventually(lambda: _ask(root, "get_server_list") is not None)
            pid = _pid(root)
            desired_path(root).write_text('{"version": 1, "sets": [{"resource": "../etc"')
            assert eventually(lambda: keeper.problem is not None and "not JSON" in keeper.problem)
            assert _pid(root) == pid  # not quit
            os.kill(pid or 0, signal.SIGKILL)
            assert eventually(lambda: _pid(root) not in (None, pid) and _ask(root, "get_server_list") is not None)
            desired_path(root).unlink()  # gone: still the last good state
            passes = keeper.passes
            assert eventually(lambda: keeper.passes > passes + 2)
            assert keeper.problem == "missing" and _ask(root, "get_server_list") is not None
            write_desired(root, [])
            assert eventually(lambda: _ask(root, "get_server_list") is None)
            assert keeper.problem is None
        finally:
            keeper.stop()
            _ask(root, "quit")


def test_a_set_taken_out_while_no_keeper_ran_is_quit_by_the_next() -> None:
    with short_dir("keep-") as root:
        _left_by_a_stopped_keeper(root)
        write_desired(root, [])  # the plugin took the set out while the keeper was down
        second = _keeper(root)
        try:
            second.step()
            assert _pid(root) is None and _ask(root, "get_server_list") is None
        finally:
            second.stop()
            _ask(root, "quit")


def test_no_file_or_a_refused_one_quits_nothing_unknown() -> None:
    with short_dir("keep-") as root:
        _left_by_a_stopped_keeper(root)
        try:
            for text in (None, "garbage"):
                if text is None:
                    desired_path(root).unlink()
                else:
                    desired_path(root).write_text(text)
                keeper = _keeper(root)
                keeper.step()
                keeper.stop()
                assert _ask(root, "get_server_list") is not None, text
        finally:
            _ask(root, "quit")
