"""The one background-loop shape (gputopo.workers.Worker): start once, stop from anywhere, never wait out a sleep."""

from __future__ import annotations

import io
import json
import logging
import threading

import pytest
import structlog

from gputopo.logs import configure_logging
from gputopo.workers import Worker


class Ticker(Worker):
    """Counts passes; each pass pauses for `pause_s` (an hour by default: only wake() or stop() end it)."""

    def __init__(self, pause_s: float = 3600.0) -> None:
        super().__init__("ticker")
        self.passes = 0
        self.pause_s = pause_s
        self.passed = threading.Condition()
        self.interrupted = 0

    def loop(self) -> None:
        while True:
            with self.passed:
                self.passes += 1
                self.passed.notify_all()
            if self.pause(self.pause_s):
                return

    def interrupt(self) -> None:
        self.interrupted += 1

    def wait_passes(self, n: int) -> bool:
        with self.passed:
            return self.passed.wait_for(lambda: self.passes >= n, timeout=30)


def test_stop_ends_an_hour_long_pause_and_calls_interrupt() -> None:
    ticker = Ticker().start()
    assert ticker.wait_passes(1) and ticker.running
    ticker.stop(timeout=30)
    assert not ticker.running and ticker.stopping
    assert ticker.interrupted == 1
    ticker.stop()  # twice is fine
    assert ticker.passes == 1


def test_wake_runs_the_next_pass_now() -> None:
    with Ticker() as ticker:
        assert ticker.wait_passes(1)
        ticker.wake()
        assert ticker.wait_passes(2)
        ticker.wake()
        assert ticker.wait_passes(3)


def test_an_unwakeable_pause_ignores_wake_but_not_stop() -> None:
    class Coalescer(Worker):
        def __init__(self) -> None:
            super().__init__("coalescer")
            self.started = threading.Event()
            self.done = threading.Event()
            self.result: bool | None = None

        def loop(self) -> None:
            self.started.set()
            self.result = self.pause(3600, wakeable=False)
            self.done.set()

    worker = Coalescer().start()
    assert worker.started.wait(30)
    worker.wake()
    assert not worker.done.wait(0.5)  # a wake-up does not end a coalescing pause
    worker.stop(timeout=30)
    assert worker.done.is_set() and worker.result is True


def test_pause_after_stop_returns_at_once_every_time() -> None:
    worker = Ticker()
    worker.stop()
    assert worker.pause(3600) and worker.pause(3600)


def test_started_once() -> None:
    with Ticker() as ticker, pytest.raises(RuntimeError, match="already started"):
        ticker.start()


def test_a_crashing_loop_ends_its_thread_and_says_so() -> None:
    class Crasher(Worker):
        def loop(self) -> None:
            raise RuntimeError("boom")

    stream = io.StringIO()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    configure_logging("info", stream)
    try:
        worker = Crasher("crasher").start()
        worker.stop(timeout=30)
    finally:
        structlog.reset_defaults()
        root.handlers[:], root.level = handlers, level
    assert not worker.running
    events = [json.loads(line) for line in stream.getvalue().splitlines()]
    crash = next(e for e in events if e["event"] == "worker.thread.crashed")
    assert crash["worker"] == "crasher" and "boom" in json.dumps(crash["exception"])


LOGS_UNTIL_STOPPED = """
import sys
import structlog
from gputopo.logs import configure_logging
from gputopo.workers import stop_on_signals

configure_logging("info", sys.stderr)
log = structlog.get_logger("busy")
stop = stop_on_signals("busy")
print("ready", flush=True)
while not stop.is_set():
    log.info("busy.line", padding="x" * 200)
"""


def test_a_signal_while_the_main_thread_writes_a_log_line_still_stops_it(tmp_path) -> None:
    """structlog's stream lock is not reentrant and Python runs signal handlers in the main thread, between two
    bytecodes of whatever it was doing: a handler that logs, landing while the main thread holds that lock, waits
    for itself forever. A process that logs all the time is stopped, every time."""
    import subprocess
    import sys
    import time

    from tests.helpers.processes import stop_process

    for _ in range(5):
        with open(tmp_path / "log", "wb") as out:
            process = subprocess.Popen([sys.executable, "-c", LOGS_UNTIL_STOPPED], stdout=subprocess.PIPE, stderr=out)
        assert process.stdout is not None and process.stdout.readline() == b"ready\n"
        time.sleep(0.05)
        stop_process(process, timeout=10, log=tmp_path / "log")
        assert process.returncode == 0
        assert '"worker.signal.received"' in (tmp_path / "log").read_text()


def test_run_passes_keeps_going_after_a_failed_pass_and_logs_it() -> None:
    """The one loop of the workers that decide on state: a pass that raises is logged and retried, the next passes
    run at the delays the passes return, and stop() ends it."""

    class Passes(Worker):
        def __init__(self) -> None:
            super().__init__("passes")
            self.calls = 0
            self.done = threading.Event()

        def step(self) -> float:
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("one bad pass")
            if self.calls == 4:
                self.done.set()
            return 0.0

        def loop(self) -> None:
            self.run_passes(self.step, retry_s=0.0,
                            failed=lambda: structlog.get_logger().exception("test.pass_failed", worker_id=7))

    with structlog.testing.capture_logs() as logs, Passes() as worker:
        assert worker.done.wait(10)
    assert worker.calls >= 4
    failed = [e for e in logs if e["event"] == "test.pass_failed"]
    assert len(failed) == 1 and failed[0]["worker_id"] == 7 and failed[0]["log_level"] == "error"
