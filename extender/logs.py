"""Structured logging for the extender process: the same configuration as every `gpuplugin` command."""

from __future__ import annotations

from gputopo.logs import configure_logging

LEVELS = ("debug", "info", "warning", "error")

__all__ = ["LEVELS", "configure_logging"]
