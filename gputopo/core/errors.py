"""Typed errors of the core. Each carries the context a caller needs to say what was wrong."""

from __future__ import annotations


class CoreError(Exception):
    """Base of every error the core raises on bad input."""


class TopologyError(CoreError):
    """A topology is inconsistent (shape, symmetry, ids, values)."""


class TopologyParseError(TopologyError):
    """Topology text or JSON could not be read. `row` and `column` name the cell when the problem is in a matrix."""

    def __init__(self, message: str, *, source: str = "", row: str | None = None, column: str | None = None):
        self.source = source
        self.row = row
        self.column = column
        where = []
        if source:
            where.append(source)
        if row is not None:
            where.append(f"row {row}")
        if column is not None:
            where.append(f"column {column}")
        super().__init__(f"{': '.join([', '.join(where)] if where else [])}{': ' if where else ''}{message}")


class TopologyFormatError(TopologyParseError):
    """Compact topology or state JSON is malformed or of a version this build does not read."""


class AllocationError(CoreError):
    """A request to the allocator cannot be satisfied as asked (bad size, unknown or duplicate ids, ...)."""
