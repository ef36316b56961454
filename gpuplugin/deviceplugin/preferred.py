"""The answer to one GetPreferredAllocation container request, from a plan or from the core allocator.

Why it never raises: the kubelet fails pod admission on an RPC error here, while a merely imperfect answer costs
nothing (the kubelet intersects it with its candidates and fills any shortfall itself). So every problem with a
request is recorded in `Preference.problems` and answered with the best valid choice still possible.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import structlog

from gpuplugin.deviceplugin.devices import Device
from gpuplugin.deviceplugin.plans import PlanSource
from gputopo.core.allocator import best_subset
from gputopo.core.topology import Topology

log = structlog.get_logger(__name__)


class Source(StrEnum):
    PLAN = "plan"
    ALLOCATOR = "allocator"
    FALLBACK = "fallback"


class FallbackReason(StrEnum):
    """Why the answer is not a plan (a metrics label: keep the set small and stable)."""

    NO_PLAN = "no_plan"  # no plan source, or it had no plan for this request
    PLAN_REJECTED = "plan_rejected"  # a plan that does not fit the request
    PLAN_ERROR = "plan_error"  # the plan source raised
    BAD_REQUEST = "bad_request"  # unknown or repeated ids, impossible size
    ALLOCATOR_ERROR = "allocator_error"  # the allocator raised on a request that looked valid


@dataclass(frozen=True)
class Preference:
    """The chosen ids (in GPU index order), where they came from, and what was wrong with the request if anything."""

    ids: tuple[str, ...]
    source: Source
    reason: FallbackReason | None = None
    problems: tuple[str, ...] = field(default=())


@dataclass
class _Request:
    available: list[Device]
    must: list[Device]
    size: int
    problems: list[str]


def _sanitize(
    by_id: Mapping[str, Device], available_ids: Sequence[str], must_ids: Sequence[str], size: int
) -> _Request:
    problems: list[str] = []

    def known(ids: Sequence[str], what: str) -> list[Device]:
        out: list[Device] = []
        seen: set[str] = set()
        for dev_id in ids:
            if dev_id in seen:
                problems.append(f"{what} lists {dev_id!r} twice")
                continue
            seen.add(dev_id)
            dev = by_id.get(dev_id)
            if dev is None:
                problems.append(f"{what} holds unknown device id {dev_id!r}")
                continue
            out.append(dev)
        return out

    available = known(available_ids, "available")
    must = known(must_ids, "must_include")
    avail_set = {d.id for d in available}
    outside = [d for d in must if d.id not in avail_set]
    if outside:
        problems.append(f"must_include ids not in available: {', '.join(d.id for d in outside)}")
        must = [d for d in must if d.id in avail_set]
    return _Request(available, must, size, problems)


def _ordered(devices: Sequence[Device]) -> tuple[str, ...]:
    return tuple(d.id for d in sorted(devices, key=lambda d: d.index))


def _check_plan(plan: object, req: _Request) -> str | None:
    """Why `plan` cannot answer `req`, or None when it fits."""
    if not isinstance(plan, (list, tuple)) or not all(isinstance(x, str) for x in plan):
        return f"plan is not a list of ids: {plan!r}"
    if len(set(plan)) != len(plan):
        return f"plan repeats ids: {list(plan)}"
    if len(plan) != req.size:
        return f"plan has {len(plan)} ids, the request asks for {req.size}"
    avail = {d.id for d in req.available}
    outside = [x for x in plan if x not in avail]
    if outside:
        return f"plan ids not available: {', '.join(outside)}"
    missing = [d.id for d in req.must if d.id not in plan]
    if missing:
        return f"plan lacks must-include ids: {', '.join(missing)}"
    return None


def choose_preferred(
    topo: Topology,
    by_id: Mapping[str, Device],
    available_ids: Sequence[str],
    must_include_ids: Sequence[str],
    size: int,
    plans: PlanSource | None = None,
) -> Preference:
    """Answer one container request. Never raises (see the module docstring)."""
    req = _sanitize(by_id, available_ids, must_include_ids, size)
    if size <= 0:
        return Preference((), Source.FALLBACK, FallbackReason.BAD_REQUEST, (*req.problems, f"size {size} <= 0"))
    if size > len(req.available):
        problems = (*req.problems, f"size {size} exceeds the {len(req.available)} valid available devices")
        return Preference(_ordered(req.available), Source.FALLBACK, FallbackReason.BAD_REQUEST, problems)
    if len(req.must) > size:
        problems = (*req.problems, f"must_include has {len(req.must)} ids, more than the size {size}")
        return Preference(_ordered(req.must[:size]), Source.FALLBACK, FallbackReason.BAD_REQUEST, problems)

    reason = FallbackReason.BAD_REQUEST if req.problems else FallbackReason.NO_PLAN
    problems = list(req.problems)
    if plans is not None and not req.problems:
        try:
            plan = plans.pending_plan([d.id for d in req.available], [d.id for d in req.must], size)
        except Exception as e:  # a faulty plan source must not fail pod admission
            reason = FallbackReason.PLAN_ERROR
            problems.append(f"plan source raised {type(e).__name__}: {e}")
        else:
            if plan is not None:
                why = _check_plan(plan, req)
                if why is None:
                    return Preference(_ordered([by_id[x] for x in plan]), Source.PLAN)
                reason = FallbackReason.PLAN_REJECTED
                problems.append(why)

    try:
        choice = best_subset(topo, [d.index for d in req.available], size, [d.index for d in req.must])
    except Exception as e:  # the allocator's own errors and anything unexpected: answer, do not fail admission
        log.exception("plugin.preferred.allocator_failed", size=size, available=[d.id for d in req.available])
        chosen = list(req.must) + [d for d in req.available if d not in req.must]
        problems.append(f"allocator raised {type(e).__name__}: {e}")
        return Preference(_ordered(chosen[:size]), Source.FALLBACK, FallbackReason.ALLOCATOR_ERROR, tuple(problems))
    by_index = {d.index: d for d in req.available}
    return Preference(_ordered([by_index[i] for i in choice.gpus]), Source.ALLOCATOR, reason, tuple(problems))
