"""The one shape of a background loop in this project: a named daemon thread, started once, stopped from any
thread (twice is fine), usable as a context manager, and woken early when there is work or when it must stop.

Every long-lived loop (API watches, the node publisher, the device plugin's registration loop, health probes, the
extender's reservation expiry) is a `Worker`, so they all start, stop and log the same way, and a stop never waits
out a sleep: `pause()` returns as soon as `stop()` or `wake()` is called.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable
from typing import Self

import structlog

log = structlog.get_logger(__name__)


def stop_on_signals(process: str) -> threading.Event:
    """The event a process's main thread waits on: set by SIGTERM (the kubelet stopping the pod) or SIGINT, each
    logged with the signal's and the process's name. Call from the main thread (Python delivers signals there)."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()
        # Not logged here: the handler runs in the main thread between two of its bytecodes, maybe inside a log
        # write holding structlog's stream lock, which is not reentrant; a log call here would wait for itself.
        threading.Thread(target=log.info, args=("worker.signal.received",), name="signal-log",
                         kwargs={"signal": signal.Signals(signum).name, "process": process}).start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


class Teardown(contextlib.ExitStack):
    """What undoes a process's start, in reverse order when its block ends. A step that fails is logged and the
    others still run: one stuck client must not leave the plugin's socket or the other workers behind."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def undo(self, step: Callable[[], object]) -> None:
        self.callback(self._run, step)

    def _run(self, step: Callable[[], object]) -> None:
        try:
            step()
        except Exception:
            log.exception("worker.teardown.step_failed", process=self.process,
                          step=getattr(step, "__qualname__", repr(step)))


class Worker:
    """Subclasses implement `loop()` (return when `stopping` is set) and may override `interrupt()` to unblock a
    call that `pause()` cannot reach (an open HTTP stream, a server's accept loop)."""

    def __init__(self, name: str, *, join_timeout_s: float = 5.0) -> None:
        self.name = name
        self.join_timeout_s = join_timeout_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # -- for the owner ----------------------------------------------------------------------------------------

    def start(self) -> Self:
        if self._thread is not None:
            raise RuntimeError(f"worker {self.name} already started")
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Ask the loop to end, unblock it, and wait for it (not when called from the loop itself)."""
        self._stop.set()
        self._wake.set()
        self.interrupt()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(self.join_timeout_s if timeout is None else timeout)
        if thread.is_alive():
            log.warning("worker.thread.stop_timeout", worker=self.name)

    def wake(self) -> None:
        """Run the next pass now instead of after the current pause."""
        self._wake.set()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- for the loop -----------------------------------------------------------------------------------------

    def loop(self) -> None:
        raise NotImplementedError

    def interrupt(self) -> None:
        """Unblock what the loop may be blocked in; called by stop() from another thread."""

    def pause(self, seconds: float, *, wakeable: bool = True) -> bool:
        """Sleep up to `seconds`, ending early on stop() and, when `wakeable`, on wake(); True when the worker is
        stopping. Either way the wake-ups that arrived are consumed: the pass that follows serves them."""
        if not self._stop.is_set() and seconds > 0:
            (self._wake if wakeable else self._stop).wait(seconds)
        if self._stop.is_set():
            return True  # wake stays set, so every later pause returns at once too
        self._wake.clear()
        return False

    def _main(self) -> None:
        try:
            self.loop()
        except Exception:  # the loop's own handlers missed it: say so rather than die silently
            log.exception("worker.thread.crashed", worker=self.name)
