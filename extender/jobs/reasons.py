"""The words of job plans: in filter answers, as kube-scheduler shows them in a pod's FailedScheduling event, and in
the job's part of a bound pod's placement explanation (`<prefix>/placement`).

kube-scheduler counts identical reasons ("0/8 nodes are available: 6 job ml/train-7: ..., 2 Insufficient cpu"),
so every node a job's pod cannot use gets one and the same sentence, and each sentence is bounded: the event stays
one readable line however many nodes or pods there are. A filter reason is a Reason (extender.placement.reasons) of
at most MAX_REASON characters: every sentence here is written to fit whole, its names, notes and quoted values
elided in their middle when they are long (`fit`), so none is cut at its end ("... still growing, so it...").
Counts agree with their nouns ("1 other job", "1 more worker").
"""

from __future__ import annotations

from extender.placement.reasons import MAX_REASON_CHARS, Worded, elided, fit, plural

__all__ = ["MAX_JOB_TEXT", "MAX_REASON", "bounded", "job_says", "literal", "noun", "plural"]

# A job's filter reason is the same on every node it refuses: one entry of the pod's event however many nodes, so
# it may take more than a node's own reason (MAX_REASON_CHARS) and still leave room in the event's 1024 bytes.
MAX_REASON = MAX_REASON_CHARS + 100
MAX_JOB_TEXT = 330  # the job's part of a placement explanation (extender.placement.explain fits the whole in 400)
_SHOWN_NODES = 4


def bounded(text: str, limit: int = MAX_REASON) -> str:
    """At most `limit` characters, elided in the middle (a pod's labels may carry long garbage)."""
    return elided(text, limit)


def literal(text: str) -> str:
    """`text` as literal words of a template (its braces doubled)."""
    return text.replace("{", "{{").replace("}", "}}")


def noun(n: int, word: str) -> str:
    """`word` agreeing with n: 'worker' for 1, 'workers' otherwise."""
    return word if n == 1 else word + "s"


def job_says(job: str, template: str, limit: int = MAX_REASON, **fields: object) -> str:
    """'job ml/train-7: <template with fields>' in at most `limit` characters, the job's name and the fields elided
    when long, the template's words whole. Literal braces in the template are doubled."""
    return fit("job {job}: " + template, limit, job=job, **fields)


def not_in_plan(job: str, placed: int, size: int | None, role: str, open_slots: int, where: str,
                nodes: list[str], gbps: float | None) -> str:
    """'job ml/train-7: not in its plan (3/4 workers placed, 1 planned on rack r12: n7; est. 50.0 GB/s)', the same
    for every node outside the plan. Short: kube-scheduler gets it once per node (5,000 nodes: 5,000 copies). No
    estimate when there is none (no plan, or one GPU in all)."""
    total = size if size is not None else "?"
    shown = ""
    if nodes and where != f"node {nodes[0]}":
        shown = ": " + nodes[0] + (f" +{len(nodes) - 1}" if len(nodes) > 1 else "")
    est = f"; est. {gbps:.1f} GB/s" if gbps else ""
    return job_says(job, f"not in its plan ({placed}/{total} {noun(size or 2, role)} placed, {open_slots} planned on "
                         f"{{where}}"
                         f"{{shown}}{est})", where=where, shown=shown)


def first_pod_waits(job: str, note: str | None, gpus: int, others: int, size_key: str) -> str:
    """A job of unknown size whose first pod finds room only where other such jobs still grow
    (extender.jobs.spread)."""
    return job_says(job, f"size unknown ({{note}}); its first pod waits: the nodes with room for {plural(gpus, 'GPU')} "
                         f"hold {plural(others, 'other job')} of unknown size still growing (set {{key}} to plan it "
                         "whole)", note=note or "nothing says it", key=size_key)


def pod_problem(pod: str, problem: str) -> str:
    """A pod whose job cannot be planned: its membership or GPU count is wrong."""
    return fit("pod {pod}: {problem}", MAX_REASON, pod=pod, problem=problem)


# -- the job's part of a bound pod's placement explanation ----------------------------------------------------------


def nodes_shown(counts: dict[str, int]) -> str:
    """'n1 x2, n2 x2', the first _SHOWN_NODES nodes by name, '+3 nodes' for the rest."""
    nodes = sorted(counts.items())
    return ", ".join(f"{n} x{c}" for n, c in nodes[:_SHOWN_NODES]) + (
        f" +{len(nodes) - _SHOWN_NODES} nodes" if len(nodes) > _SHOWN_NODES else "")


def figure(placed: int, total: str, role: str, where: str, counts: dict[str, int],
           estimate: str) -> tuple[str, dict[str, object]]:
    """The words of a job's pods seen together, as a template and its fields: '3 of ? workers on node n0 (n0 x3),
    est. 25.8 GB/s all-reduce, limited by the host path'."""
    of = f"{placed} of {total} {noun(2 if total == '?' else int(total), role)}"
    return f"{of} on {{where}} ({{nodes}}), {literal(estimate)}", {"where": where, "nodes": nodes_shown(counts)}


def job_explained(job: str, known: str, said: str, **fields: object) -> Worded:
    """'job ml/x (<how its size is known>): <said>', at most MAX_JOB_TEXT characters: `said` (a template whose
    fields come in `fields`) keeps its words; the job's name, how its size is known and the fields are elided
    first. `within(n)` words it again in fewer characters (the explanation's other parts may leave less)."""
    return Worded("job {job} ({known}): " + said, MAX_JOB_TEXT, job=job, known=known, **fields)
