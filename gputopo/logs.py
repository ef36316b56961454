"""Structured logs for both binaries: one configuration, JSON lines off a terminal, readable text on one.

Our own events are named `component.noun.verb` (tests/architecture checks every call). Lines from libraries that
log through the standard library (uvicorn, the kubernetes client, urllib3, grpc) go through the same renderer, so a
log collector sees one format: their text becomes the `message` field and their event is
`<component>.<library>.message` (for example `extender.uvicorn.message`).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
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
            event_dict.pop("color_message", None)  # uvicorn's ANSI twin of the message
        return event_dict

    return rename


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
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    # The standard library's records (uvicorn, kubernetes, urllib3, grpc) through the same processors.
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[*shared, _foreign_event(component), structlog.stdlib.ExtraAdder()],
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
