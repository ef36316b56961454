"""Ranking DRA nodes for a pod: what the pod would get on each node, and the scores that prefer the best.

kube-scheduler scores DRA nodes only by the index of the `firstAvailable` tier a claim can use (docs/reference/
dra-api.md §6), so among nodes where one tier fits its choice is blind, and `nvidia.com/gpu: N` served through a
DeviceClass's extendedResourceName has no tiers at all. Here each node's answer mirrors the allocator on our
driver's published order (extender.state.slices): per tier, the first free set of the tier's size whose
`allreduceGBps` meets the tier's selector, or the first N free singles of the tier's class; the value is that set's
GB/s, and the nodes are scored in extender.placement.scoring's bands, as the device-plugin path scores them.

What a pod asks is read from its claims' requests by DeviceClass name, as deploy/dra/deviceclasses.yaml and the
chart name them: `gpu-set-<N>.<driver>` (a set of N), `gpu.<driver>` (ring-ordered singles, count N),
`one-gpu.<driver>` (1-GPU order). Of CEL selectors only `allreduceGBps >= <int>` is understood; others are left to
the allocator (they only narrow what a node can give, and kube-scheduler's own filter has dropped the nodes where
nothing fits).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from extender.placement.scoring import priority_scores
from extender.state.slices import DraNode, GpuSet

SET, RINGS, ONE = "set", "rings", "one"
_MIN_GBPS = re.compile(r"allreduceGBps\s*>=?\s*(\d+)")


@dataclass(frozen=True)
class Tier:
    kind: str  # SET, RINGS or ONE
    size: int
    min_gbps: int = 0


@dataclass(frozen=True)
class DraAsk:
    """One GPU request of a pod, as tiers best first (a plain `exactly` request is one tier)."""

    size: int
    tiers: tuple[Tier, ...]


@dataclass(frozen=True)
class DraOffer:
    gpus: GpuSet
    gbps: float


def plain_ask(size: int) -> DraAsk:
    """`nvidia.com/gpu: N` on a DRA node: N singles of the extended-resource class, ring order."""
    return DraAsk(size, (Tier(RINGS, size),))


def _tier(sub: Mapping[str, Any], driver: str) -> Tier | None:
    cls = str(sub.get("deviceClassName") or "")
    suffix = f".{driver}"
    if not cls.endswith(suffix):
        return None
    base = cls[: -len(suffix)]
    mode = sub.get("allocationMode") or "ExactCount"
    if mode != "ExactCount":
        return None
    count = sub.get("count", 1)
    count = count if isinstance(count, int) and count > 0 else 1
    min_gbps = 0
    for sel in sub.get("selectors") or []:
        expr = str(((sel or {}).get("cel") or {}).get("expression") or "")
        m = _MIN_GBPS.search(expr)
        if m:
            min_gbps = max(min_gbps, int(m.group(1)))
    if base.startswith("gpu-set-") and base[8:].isdigit():
        n = int(base[8:])
        return Tier(SET, n * count, min_gbps) if count == 1 else None
    if base == "gpu":
        return Tier(RINGS, count)
    if base == "one-gpu":
        return Tier(ONE, count)
    return None


def request_ask(request: Mapping[str, Any], driver: str) -> DraAsk | None:
    """The ask of one claim request (`exactly` or `firstAvailable`), or None when no tier is ours."""
    subs: Sequence[Any] = request.get("firstAvailable") or ([request["exactly"]] if request.get("exactly") else [])
    tiers = [t for t in (_tier(s, driver) for s in subs if isinstance(s, dict)) if t is not None]
    if not tiers or len({t.size for t in tiers}) != 1:
        return None
    return DraAsk(tiers[0].size, tuple(tiers))


def claims_ask(requests: Iterable[Mapping[str, Any]], driver: str) -> DraAsk | None:
    """The pod's one GPU ask over all its claims' requests; None with none, or with more than one (not ranked)."""
    asks = [a for a in (request_ask(r, driver) for r in requests) if a is not None]
    return asks[0] if len(asks) == 1 else None


def offer(node: DraNode, used: frozenset[int], ask: DraAsk) -> DraOffer | None:
    """What the allocator would hand out on this node now: the first tier that fits, first free in published
    order. None when nothing fits (by this view)."""
    for tier in ask.tiers:
        if tier.kind == SET:
            for members, gbps in node.sets.get(tier.size, ()):
                if gbps >= tier.min_gbps and used.isdisjoint(members):
                    return DraOffer(members, float(gbps))
            continue
        order = node.rings if tier.kind == RINGS else node.ones
        free = [g for g in order if g not in used][: tier.size]
        if len(free) == tier.size:
            return DraOffer(tuple(sorted(free)), node.gbps_of(free))
    return None


def rank(views: Mapping[str, tuple[DraNode, frozenset[int]]], names: Sequence[str], ask: DraAsk
         ) -> tuple[list[int], list[DraOffer | None]]:
    """Scores 0-10 aligned with `names` (0 for a node without our pool, or where nothing fits by this view), and
    each node's offer. Value: the offer's GB/s (one GPU: the same everywhere); packing among equals: the node with
    fewer free GPUs first, so that emptier nodes keep their large sets."""
    offers: list[DraOffer | None] = []
    values: list[tuple[float, float] | None] = []
    for name in names:
        got = views.get(name)
        o = offer(got[0], got[1], ask) if got is not None else None
        offers.append(o)
        if o is None or got is None:
            values.append(None)
            continue
        view, used = got
        value = o.gbps if ask.size > 1 else 1.0
        values.append((value, float(-(view.gpus - len(used)))))
    return priority_scores(values), offers
