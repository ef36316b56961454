"""The words of job plans in filter answers, as kube-scheduler shows them in a pod's FailedScheduling event.

kube-scheduler counts identical reasons ("0/8 nodes are available: 6 job ml/train-7: ..., 2 Insufficient cpu"),
so every node a job's pod cannot use gets one and the same sentence, and each sentence is bounded: the event stays
one readable line however many nodes or pods there are.
"""

from __future__ import annotations

MAX_REASON = 400
_SHOWN_NODES = 4


def bounded(text: str) -> str:
    """At most MAX_REASON characters (a pod's labels may carry long garbage)."""
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


def not_in_plan(job: str, placed: int, size: int | None, role: str, open_slots: int, where: str,
                nodes: list[str], gbps: float) -> str:
    """'job ml/train-7: not in its plan (3/4 workers placed, 1 planned on rack r12: n7; est. 50.0 GB/s)', the same
    for every node outside the plan. Short: kube-scheduler gets it once per node (5,000 nodes: 5,000 copies)."""
    total = size if size is not None else "?"
    shown = ""
    if nodes and where != f"node {nodes[0]}":
        shown = ": " + nodes[0] + (f" +{len(nodes) - 1}" if len(nodes) > 1 else "")
    return bounded(f"job {job}: not in its plan ({placed}/{total} {role}s placed, {open_slots} planned on {where}"
                   f"{shown}; est. {gbps:.1f} GB/s)")


def pod_problem(pod: str, problem: str) -> str:
    """A pod whose job cannot be planned: its membership or GPU count is wrong."""
    return bounded(f"pod {pod}: {problem}")
