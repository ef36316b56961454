"""GPU sets as integer bitmasks (bit i = GPU index i): cheap to hash, compare and key memos on."""

from __future__ import annotations

from collections.abc import Iterable


def mask_of(indices: Iterable[int]) -> int:
    m = 0
    for i in indices:
        m |= 1 << i
    return m


def bits(mask: int) -> list[int]:
    """The indices set in `mask`, ascending."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out
