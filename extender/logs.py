"""The extender's logging: the shared configuration (gputopo.logs), with library lines named `extender.*`."""

from __future__ import annotations

from functools import partial

from gputopo import logs

configure_logging = partial(logs.configure_logging, component="extender")

__all__ = ["configure_logging"]
