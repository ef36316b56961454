"""The one shape of a background loop in this project: a named daemon thread, started once, stopped from any
thread (twice is fine), usable as a context manager, and woken early when there is work or when it must stop.

Every long-lived loop (API watches, the node publisher, the device plugin's registration loop, health probes, the
extender's reservation expiry) is a `Worker`, so they all start, stop and log the same way, and a stop never waits
out a sleep: `pause()` returns as soon as `stop()` or `wake()` is called.
"""

from __future__ import annotations

import contextlib
import math
import signal
import threading
import time
from collections.abc import Callable
from typing import Self

import structlog

log = structlog.get_logger(__name__)


SIGNAL_SLICE_S = 0.2  # the longest a caught signal waits for a waiter to act on it


class SignalStop(threading.Event):
    """The event set by SIGTERM or SIGINT (stop_on_signals). Two things make a plain Event wrong here:
    - the kernel may hand a process's signal to any of its threads (gRPC's, watchdog's), and CPython then runs the
      handler only when the main thread next runs Python code, which a plain Event.wait() without a timeout never
      does: the process ignored SIGTERM until SIGKILL (seen in bench.plugin; every time when the signal is sent
      to a thread's id). So wait() waits in slices of SIGNAL_SLICE_S;
    - the handler runs between two bytecodes of the main thread, maybe while it holds a lock that the handler would
      take (this event's own inside wait(), structlog's stream lock inside a log write, threading's when it starts
      a thread): a handler that sets an Event, logs or starts a thread can wait for itself forever. So the handler
      only notes the signal (`caught`, a list append: no lock), and the next is_set() or wait() slice, in any
      thread, sets the event and logs."""

    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process
        self._caught: list[int] = []
        self._settling = threading.Lock()  # taken in ordinary code only, never by the handler

    def caught(self, signum: int) -> None:
        """The signal handler: no lock, no log, no thread (see the class)."""
        self._caught.append(signum)

    def _settle(self) -> bool:
        if self._caught and not super().is_set():
            with self._settling:
                if not super().is_set():
                    super().set()
                    log.info("worker.signal.received", signal=signal.Signals(self._caught[0]).name,
                             process=self.process)
        return super().is_set()

    def is_set(self) -> bool:
        return self._settle()

    def wait(self, timeout: float | None = None) -> bool:
        end = math.inf if timeout is None else time.monotonic() + timeout
        while not self._settle():
            left = end - time.monotonic()
            if left <= 0:
                return False
            super().wait(min(SIGNAL_SLICE_S, left))
        return True


def stop_on_signals(process: str) -> SignalStop:
    """The event a process's main thread waits on: set by SIGTERM (the kubelet stopping the pod) or SIGINT, each
    logged with the signal's and the process's name. Call from the main thread (Python runs handlers there)."""
    stop = SignalStop(process)

    def on_signal(signum: int, _frame: object) -> None:
        stop.caught(signum)

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

    def run_passes(self, step: Callable[[], float], *, retry_s: float, failed: Callable[[], object],
                   first_delay_s: float = 0.0) -> None:
        """The loop of a worker that decides on state: `step()` makes one pass and returns the seconds until the
        next; a pass that raises is reported by `failed()`, called inside the handler (a `log.exception` with the
        worker's own event, a literal where it is written), and the next one comes `retry_s` later, so one bad
        pass never ends the worker."""
        delay = first_delay_s
        while not self.pause(delay):
            try:
                delay = step()
            except Exception:
                failed()
                delay = retry_s

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
