"""Typed errors of the DRA driver; each message names the claim, device or file and what was wrong."""

from __future__ import annotations


class DraError(Exception):
    """Base of every error the DRA driver raises."""


class ClaimError(DraError):
    """A claim cannot be prepared as allocated (not found, not allocated, foreign devices, bad config, ...)."""


class HeldElsewhere(ClaimError):
    """A claim is allocated a GPU, MIG instance or shared capacity that other prepared claims hold. `holders`:
    their UIDs, looked up before refusing (a holder whose ResourceClaim is gone was never unprepared)."""

    def __init__(self, message: str, holders: tuple[str, ...]) -> None:
        self.holders = holders
        super().__init__(message)


class StateError(DraError):
    """The prepared-claims state file cannot be read or written."""


class ServeError(DraError):
    """The driver's gRPC sockets cannot be served."""


class CapacityRefused(DraError):
    """The apiserver did not take a slice's multi-allocatable devices. `reason`: "invalid" (422) or "dropped"."""

    def __init__(self, message: str, reason: str) -> None:
        self.reason = reason
        super().__init__(message)
