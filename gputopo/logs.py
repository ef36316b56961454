"""Structured logs for every `gpuplugin` command: one configuration, JSON lines off a terminal."""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog


def configure_logging(level: str = "warning", stream: TextIO | None = None) -> None:
    """Structured logs on stderr: JSON lines when not a terminal (collectors parse them), readable otherwise."""
    stream = stream or sys.stderr
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if stream.isatty():
        processors = [*shared, structlog.dev.ConsoleRenderer()]
    else:
        processors = [*shared, structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer()]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[level.upper()]),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=logging.WARNING, stream=stream)
