"""Structured logs for both binaries: one configuration, JSON lines off a terminal, readable text on one.

Our own events are named `component.noun.verb` (tests/architecture checks every call). Lines from libraries that
log through the standard library (uvicorn, the kubernetes client, urllib3, grpc) go through the same renderer, so a
log collector sees one format: their text becomes the `message` field and their event is
`<component>.<library>.message` (for example `extender.uvicorn.message`). A binary that promises one JSON object
per line also starts a `ProcessOutput`: Python's last-resort reports (uncaught exceptions, "Exception ignored in",
warnings) then go through logging too, and lines that bypass Python (gRPC's core writes to file descriptor 2 itself)
are wrapped.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Literal, TextIO, get_args

import structlog
from structlog.typing import EventDict, WrappedLogger

# The levels both binaries' --log-level accept.
LogLevel = Literal["debug", "info", "warning", "error"]
LEVELS: tuple[str, ...] = get_args(LogLevel)
# How often a warning a client can repeat without end is logged at most.
REPEAT_INTERVAL_S = 10.0


class Repeats:
    """When to log a warning that a client can cause without end (a refused stream, a failed accept, an allocation
    the host cannot back): the first at once, then at most one line per `interval_s`, which says how many were not
    logged since the line before. A hostile or broken client must not fill the node's disk, and one line per
    interval still says that it goes on and how much. The caller logs (the event stays a literal at the call site):

        quiet = self._refusals.admit()
        if quiet is not None:
            log.warning("plugin.listandwatch.refused", ..., not_logged_since_last=quiet)

    Thread-safe. `clock` is injected so tests can move time.
    """

    def __init__(self, interval_s: float = REPEAT_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: float | None = None
        self._quiet = 0

    def admit(self) -> int | None:
        """None: stay quiet (this one is counted). Otherwise log now; the number is how many were not logged since
        the last line (0 for the first)."""
        now = self._clock()
        with self._lock:
            if self._last is not None and now - self._last < self.interval_s:
                self._quiet += 1
                return None
            quiet, self._last, self._quiet = self._quiet, now, 0
            return quiet


def _level_number(level: str) -> int:
    try:
        return logging.getLevelNamesMapping()[level.upper()]
    except KeyError:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LEVELS)}") from None


def _foreign_event(component: str) -> Any:
    """Renames a standard-library record's text to `message` and names its event after the library."""

    def rename(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
        record = event_dict.get("_record")
        if record is not None and not event_dict.get("_from_structlog", False):
            library = record.name.split(".", 1)[0].replace("-", "_").lower() or "root"
            event_dict["message"] = event_dict.pop("event", "")
            event_dict["event"] = f"{component}.{library}.message"
            event_dict["logger"] = record.name
        return event_dict

    return rename


# Fields libraries pass in `extra=` for a coloured terminal formatter only: uvicorn's `color_message`, the message
# again with ANSI escapes. Our renderers print the plain message, so these would only put escapes in the output.
_TERMINAL_ONLY = ("color_message",)


def _drop_terminal_only(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
    """Runs after ExtraAdder, which copies every `extra=` field of a record into the event (dropping them before
    it, as this module once did, let them back in)."""
    for key in _TERMINAL_ONLY:
        event_dict.pop(key, None)
    return event_dict


def configure_logging(level: str = "warning", stream: TextIO | None = None, *, component: str = "plugin") -> None:
    """Structured logs on `stream` (stderr): JSON lines when not a terminal (collectors parse them), readable text
    otherwise. `component` names the binary in events that come from other libraries."""
    stream = stream or sys.stderr
    number = _level_number(level)
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Any = (
        structlog.dev.ConsoleRenderer()
        if stream.isatty()
        else structlog.processors.JSONRenderer()
    )
    tail: list[Any] = [] if stream.isatty() else [structlog.processors.dict_tracebacks]
    structlog.configure(
        processors=[*shared, *tail, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(number),
        # One write per line (print() writes the newline apart): on a pipe that gRPC's core writes to as well, a
        # line of its own could otherwise land between a line and its newline.
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    # The standard library's records (uvicorn, kubernetes, urllib3, grpc) through the same processors.
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, _foreign_event(component), structlog.stdlib.ExtraAdder(), _drop_terminal_only],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *tail, renderer],
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # Libraries stay at warning and above unless we debug: their info lines are per-request noise.
    root.setLevel(number if number <= logging.DEBUG else max(number, logging.WARNING))
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        library = logging.getLogger(name)
        library.handlers.clear()
        library.propagate = True
        library.setLevel(number)  # uvicorn's start and stop lines are worth seeing at info


# gRPC's core logs through absl straight to file descriptor 2: "I1207 17:24:55.685454    4540 file.cc:1403] text".
_ABSL_LINE = re.compile(r"^([IWEF])\d{4} [\d:.]+\s+\d+ ([^\]\s]+)\] ?(.*)$")
_ABSL_LEVELS = {"I": "info", "W": "warning", "E": "error", "F": "critical"}
_DECODER = json.JSONDecoder()


def _python_reports() -> Callable[[], None]:
    """Python's own last-resort reports through logging (and so through the renderer) instead of raw tracebacks
    on stderr: an exception a thread did not catch, one the main thread did not catch, an "Exception ignored in"
    (sys.unraisablehook: a failing __del__, a generator finalized on a closed loop) and warnings. Returns the
    function that puts the previous hooks back."""
    saved = (threading.excepthook, sys.excepthook, sys.unraisablehook)
    reports = logging.getLogger("python")

    def thread_hook(args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:
            return
        name = args.thread.name if args.thread is not None else "?"
        reports.error("uncaught exception in thread %s", name,
                      exc_info=(args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback))

    def main_hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        reports.critical("uncaught exception", exc_info=(kind, value, tb))

    def unraisable_hook(args: Any) -> None:
        what = args.err_msg or "Exception ignored in"
        reports.error("%s: %r", what, args.object,
                      exc_info=(args.exc_type, args.exc_value or args.exc_type(), args.exc_traceback))

    threading.excepthook, sys.excepthook, sys.unraisablehook = thread_hook, main_hook, unraisable_hook
    logging.captureWarnings(True)

    def restore() -> None:
        threading.excepthook, sys.excepthook, sys.unraisablehook = saved
        logging.captureWarnings(False)

    return restore


class _Relay:
    """File descriptor `fd` replaced by a pipe whose lines a thread copies to where `fd` went before: a line that
    is a JSON object unchanged (our own logs), any other line wrapped in one (gRPC's core, a C library, a stray
    print), so that a collector never sees a line it cannot parse."""

    def __init__(self, fd: int, component: str, level: int) -> None:
        self.fd = fd
        self._component = component
        # The libraries' threshold (configure_logging): warning and above unless we debug.
        self._level = level if level <= logging.DEBUG else max(level, logging.WARNING)
        self._stream = {1: "stdout", 2: "stderr"}.get(fd, str(fd))
        self._target = os.dup(fd)
        read, write = os.pipe()
        os.dup2(write, fd)
        os.close(write)
        self._read = read
        self._thread = threading.Thread(target=self._copy, name=f"log-relay-{self._stream}", daemon=True)
        self._thread.start()

    @property
    def target(self) -> int:
        """The file descriptor the lines go to (where `fd` went before)."""
        return self._target

    def _copy(self) -> None:
        pending = b""
        try:
            while chunk := os.read(self._read, 65536):
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    self._write(line)
            if pending:
                self._write(pending)
        except OSError:  # the target is gone (closed at exit): nowhere left to write
            pass
        finally:
            os.close(self._read)

    def _write(self, raw: bytes) -> None:
        text = raw.decode(errors="replace").rstrip("\r")
        if text.startswith("{"):
            try:
                entry, end = _DECODER.raw_decode(text)
            except ValueError:
                entry, end = None, 0
            if isinstance(entry, dict):
                os.write(self._target, text[:end].encode() + b"\n")
                text = text[end:]  # another writer's line, written before this one's newline
        if text.strip():
            self._wrap(text)

    def _wrap(self, text: str) -> None:
        entry: dict[str, Any] = {"stream": self._stream}
        m = _ABSL_LINE.match(text)
        if m:
            level, library = _ABSL_LEVELS[m.group(1)], "grpc"
            entry.update(source=m.group(2), message=m.group(3))
        else:
            level, library = "warning", "native"
            entry["message"] = text
        if _level_number(level) < self._level:
            return
        entry.update(event=f"{self._component}.{library}.message", level=level,
                     timestamp=datetime.now(UTC).isoformat().replace("+00:00", "Z"))
        os.write(self._target, json.dumps(entry).encode() + b"\n")

    def close(self) -> None:
        """Put `fd` back where it went before and copy what is left in the pipe (the thread ends at its end)."""
        os.dup2(self._target, self.fd)  # the pipe's last write end goes: the thread reads to the end and stops
        self._thread.join(5.0)
        if not self._thread.is_alive():  # else a child holds the pipe: leave the thread its target (never reused)
            os.close(self._target)


class ProcessOutput:
    """Every line this process writes on stdout and stderr one JSON object, for a binary whose logs a collector
    parses (configure_logging first). Python's last-resort reports (uncaught exceptions in any thread,
    "Exception ignored in", warnings) go through logging; what bypasses Python altogether, gRPC's core logging
    through absl straight to file descriptor 2 above all, is read back from a pipe and wrapped, an event
    `<component>.grpc.message` (or `.native.message`) at the line's own level. Nothing is done on a terminal (a
    person reads it: the readable renderer is in use) or where stderr is not this process's file descriptor 2 (a
    test's captured output). start() then stop(); stop() waits for the relayed lines to be written."""

    def __init__(self, component: str = "plugin", level: str = "warning") -> None:
        self.component = component
        self.level = _level_number(level)
        self._relays: list[_Relay] = []
        self._restore: Callable[[], None] | None = None
        self._fault_file: TextIO | None = None

    def start(self) -> ProcessOutput:
        if not _is_own_fd(sys.stderr, 2) or sys.stderr.isatty():
            return self
        self._restore = _python_reports()
        for stream, fd in ((sys.stdout, 1), (sys.stderr, 2)):
            if _is_own_fd(stream, fd):
                stream.flush()
                self._relays.append(_Relay(fd, self.component, self.level))
        if faulthandler.is_enabled():
            # A hang's stack dump comes as the process is aborted, before any thread could relay it: straight out.
            self._fault_file = os.fdopen(self._relays[-1].target, "w", closefd=False)
            faulthandler.enable(self._fault_file)
        return self

    def stop(self) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        if self._fault_file is not None:
            faulthandler.enable(sys.stderr)
            self._fault_file = None
        relays, self._relays = self._relays, []
        for relay in relays:
            relay.close()
        restore, self._restore = self._restore, None
        if restore is not None:
            restore()


def _is_own_fd(stream: TextIO | None, fd: int) -> bool:
    try:
        return stream is not None and stream.fileno() == fd
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both OSError and ValueError
        return False
