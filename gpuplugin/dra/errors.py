"""Typed errors of the DRA driver; each message names the claim, device or file and what was wrong."""

from __future__ import annotations


class DraError(Exception):
    """Base of every error the DRA driver raises."""


class ClaimError(DraError):
    """A claim cannot be prepared as allocated (not found, not allocated, foreign devices, bad config, ...)."""


class StateError(DraError):
    """The prepared-claims state file cannot be read or written."""


class ServeError(DraError):
    """The driver's gRPC sockets cannot be served."""
