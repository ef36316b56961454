"""The prioritize mapping: from (node value, packing) per node to kube-scheduler's 0-10.

kube-scheduler multiplies the score by the extender's weight and by 10 and adds it to its own plugins' scores, so
only the order within one request matters, and there are only 11 integer levels. They are spent like this:

1. Band, from q = node's value / the best value among this request's nodes (q = 1 for single-GPU pods). The value
   is the GB/s of the node's best subset, less what scarce larger islands the choice would break costs
   (placement.island_values); while large islands are plentiful it is the GB/s itself.
       q >= 0.999  -> 6..10   (as good as the best node offers)
       q >= 0.5    -> 3..5
       otherwise   -> 0..2
   Bands never overlap, so the score is monotone in value across bands. For nodes of one topology GB/s orders them
   exactly as placement efficiency does, since the denominator is shared; across topologies the absolute figure
   is what the job gets, so that is what is compared.
2. Packing within a band: the node's packing value (placement.Fit.packing, higher is better: first its drain
   class, how busy the node already is, so nodes can empty for autoscalers; then little lost capability of the
   node's remainder for the common sizes, weighted by size, then a tight fit) ranked among the
   distinct values in the band: the best gets the band's top level, the next one level lower, and so on; with more
   distinct values than levels, ranks share levels proportionally. So among equally good nodes, the one that keeps
   its remainder best shaped and fits most tightly always scores strictly higher when the band has room. The
   extender's own ranking passes a key that extends the packing (placement.policy.standing): for nodes valued
   below their ranking's value level it adds the raw value, then the scarce island GB/s the choice destroys, so
   that of two such equal choices the one that breaks less scores higher.
Nodes that cannot take the pod (prioritize may see a node that stopped fitting since filter) score 0.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import TypeAlias

MIN_SCORE, MAX_SCORE = 0, 10
# (lowest q, first level, number of levels), best band first
BANDS: tuple[tuple[float, int, int], ...] = ((0.999, 6, 5), (0.5, 3, 3), (0.0, 0, 3))
# what orders nodes within a band: the packing value, or a tuple that starts with it (one kind per call)
Order: TypeAlias = float | tuple[float, ...]


def priority_scores(values: Sequence[tuple[float, Order] | None]) -> list[int]:
    """values[i] = (value, packing) for node i, or None when the pod does not fit there.
    Packing values (or keys, Order) are compared as given (round them first: equal packings must be equal floats)."""
    best = max((v[0] for v in values if v is not None), default=0.0)
    bands: list[int] = []
    distinct: list[set[Order]] = [set(), set(), set()]
    for v in values:
        if v is None:
            bands.append(-1)
            continue
        b = band_of(v[0], best)
        bands.append(b)
        distinct[b].add(v[1])
    levels_of = [band_levels(b, d) for b, d in enumerate(distinct)]
    return [MIN_SCORE if b < 0 else levels_of[b][v[1]] for v, b in zip(values, bands, strict=True)]  # type: ignore[index]


def band_of(value: float, best: float) -> int:
    """The band (0 best) of a value among values whose best is `best`."""
    return 0 if best <= 0 or value >= BANDS[0][0] * best else 1 if value >= BANDS[1][0] * best else 2


def band_levels(band: int, packings: Collection[Order]) -> dict[Order, int]:
    """The level of each distinct packing value in the band."""
    _, first, levels = BANDS[band]
    n = len(packings)
    return {p: first + levels - 1 - (r if n <= levels else r * levels // n)
            for r, p in enumerate(sorted(packings, reverse=True))}
