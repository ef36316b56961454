"""Structured logs for both binaries: one configuration, JSON lines off a terminal, readable text on one.

Our own events are named `component.noun.verb` (tests/architecture checks every call). Lines from libraries that
log through the standard library (uvicorn, the kubernetes client, urllib3, grpc) go through the same renderer, so a
log collector sees one format: their text becomes the `message` field and their event is
`<component>.<library>.message` (for example `extender.uvicorn.message`).
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal, TextIO, get_args

import structlog
from structlog.typing import EventDict, WrappedLogger

# The levels both binaries' --log-level accept.
LogLevel = Literal["debug", "info", "warning", "error"]
LEVELS: tuple[str, ...] = get_args(LogLevel)


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
