"""Why a pod got its node and GPUs, in one short line written next to its plan (`<prefix>/placement`).

Prioritize sees every candidate node of the pod (the nodes that passed kube-scheduler's filters and ours) and
ranks them; `offer` keeps, per pod, what the best of them offered: the fastest set of the pod's size, on which node,
its score and the top score, and, when that node was ranked down for breaking a scarce larger NVLink island, which
island. Bind, which learns only the chosen node, then words the choice (`Explainer.explain`):

    n3 GPUs 0-3: 150.0 GB/s, efficiency vs the empty node 1.00; fastest offered 300.0 GB/s on n7, passed over to
    keep its free 8-GPU island (300 GB/s, scarce) for larger pods; require-nvlink

Reasons a faster node is passed over, as the policy has them (extender.placement.policy, extender.placement.scoring): an
island kept for larger pods (the island penalty); a tighter fit among nodes as fast (packing); kube-scheduler's own
scores or a placement in between (we ranked the faster node first, it chose another). The pod's constraints
(require-nvlink, min-allreduce-gbps) are named, since they are why nodes were refused. A pod of a job whose plan
chose its node says the job instead (extender.jobs.plans.describe: the job, how its size is known, and the job as
known at this pod's bind, labelled so: its plan for all its pods when its size is known, its pods placed so far
with this one when not): the job's filter left it one node, which is not the "not ranked" case. Other reasons come
in as `notes`.

The line is written once, with the Binding, and never patched (describe says why). It holds at most MAX_CHARS
characters and is never cut at its end: node names are shown up to NAME_SHOWN characters, the job's names and notes
are elided before its figure, and the comparison and notes are elided in their middle (`fitted`).

Kept per pod UID in a bounded map, oldest forgotten first; a pod bound without a prioritize call (one feasible node,
or an extender restart in between) is explained without the comparison.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import compress, count
from operator import attrgetter

from extender.placement import policy
from extender.placement.policy import Fit
from extender.placement.reasons import Worded, elided, gpu_list
from extender.state.pods import Need
from gputopo.core import Topology
from gputopo.core.bitset import mask_of
from gputopo.core.efficiency import VS_EMPTY, efficiency_ratio

MAX_CHARS = 400
NAME_SHOWN = 63  # a node's name as the explanation shows it, elided past this (Kubernetes allows 253)
_REST_FLOOR = 120  # what the comparison, constraints and notes keep at least when the job's words must give way
_REST_LEAST = 24  # below this they are left out rather than elided to nothing but "..."
_SEP = "; "
_GBPS = attrgetter("gbps")
_EPS = 1e-9


@dataclass(frozen=True)
class Offer:
    """What the candidates of one prioritize call offered a pod."""

    candidates: int
    fitting: int
    fastest_gbps: float
    fastest_node: str
    fastest_score: int
    top_score: int
    # (size, GB/s) of scarce larger free islands the fastest node's set would break, when that ranked it down
    kept: tuple[tuple[int, float], ...] = ()
    # a node as fast as the top-scored ones, ranked below them because fewer of its GPUs are in use (or an
    # autoscaler marked it for removal): left so it can empty (policy.drain_class)
    emptier: str = ""


def offer(names: Sequence[str], fits: Sequence[Fit], ranking: policy.Ranking, penalty: float, spare: int
          ) -> Offer | None:
    """The Offer of one prioritize answer (fits aligned with names, ranked by policy.rank); None when no node
    fits. Works on the distinct states the ranking already counted: per node, only C-level scans."""
    by_fit = ranking.by_fit
    if not ranking.counts:
        return None
    fastest = max(map(_GBPS, ranking.counts))
    # among equally fast states, the one ranked highest (equal states share one Fit, hashed by identity, and one
    # score), and its first node: the first node in any of the best states (each state's index would be quadratic)
    ties = [f for f in ranking.counts if f.gbps >= fastest - _EPS]
    score = max(by_fit[f] for f in ties)
    best_fits = {f for f in ties if by_fit[f] == score}
    i = next(compress(count(), map(best_fits.__contains__, fits)))  # C-level: the first may be far down the list
    top = max(by_fit.values())
    kept: tuple[tuple[int, float], ...] = ()
    best = fits[i]
    if score < top and best.islands and penalty > 0:
        kept = tuple((s, before) for s, before, after in policy.scarce_islands(ranking.counts, best, spare)
                     if before - after > _EPS)  # an island it leaves whole was not the reason
    return Offer(len(names), ranking.counts.total(), fastest, names[i], score, top, kept,
                 _emptier(names, fits, ranking, top))


def _emptier(names: Sequence[str], fits: Sequence[Fit], ranking: policy.Ranking, top: int) -> str:
    """The first node as fast as the top-scored states but of a lower drain class, or ""."""
    by_fit = ranking.by_fit
    tops = [f for f in ranking.counts if by_fit[f] == top]
    gbps = max(f.gbps for f in tops)
    drain = max(map(policy.drain_of, tops))
    passed = {f for f in ranking.counts if by_fit[f] < top and f.gbps >= gbps - _EPS and policy.drain_of(f) < drain}
    if not passed:
        return ""
    return names[next(compress(count(), map(passed.__contains__, fits)))]


class Explainer:
    """Offers by pod UID (bounded), and the words of a bound pod's placement."""

    def __init__(self, best_empty: Callable[[Topology, int], float], limit: int = 10_000) -> None:
        self._best_empty = best_empty
        self.limit = limit
        self._offers: OrderedDict[str, Offer | None] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, uid: str, found: Offer | None) -> None:
        if not uid:
            return
        with self._lock:
            self._offers[uid] = found
            self._offers.move_to_end(uid)
            while len(self._offers) > self.limit:
                self._offers.popitem(last=False)

    def explain(self, uid: str, node: str, topo: Topology, gpus: Sequence[int], gbps: float, need: Need,
                notes: Sequence[str] = (), job: str | None = None) -> str:
        """One line: the choice, its efficiency vs the empty node, how it compares with the fastest offered (for a
        pod of a job, `job`: the job's plan chose its node, so the plan is what it says), the constraints, and
        `notes`; at most MAX_CHARS characters."""
        with self._lock:
            known = uid in self._offers
            found = self._offers.get(uid)
        size = len(gpus)
        shown = elided(node, NAME_SHOWN)
        if size == 1:
            head = f"{shown} GPU {gpus[0]}: one GPU, no all-reduce"
        else:
            eff = efficiency_ratio(gbps, self._best_empty(topo, size), size)
            head = f"{shown} GPUs {gpu_list(mask_of(gpus))}: {gbps:.1f} GB/s, {VS_EMPTY} {eff:.2f}"
        rest = []
        if size > 1 and (job is None or known):  # a job's pod: its node came from the job's plan; ranked too if known
            rest.append(_comparison(found, known, node, gbps))
        if found is not None and found.emptier and found.emptier != node:
            rest.append(f"passed over {elided(found.emptier, NAME_SHOWN)}, as fast but with fewer GPUs in use, "
                        "so it can empty for the autoscaler")
        constraints = (["require-nvlink"] if need.require_nvlink else []) + (
            [f"min-allreduce {need.min_gbps:g} GB/s"] if need.min_gbps > 0 else [])
        if constraints:
            rest.append("constraints: " + ", ".join(constraints))
        rest.extend(notes)
        return fitted(head, job, [p for p in rest if p])


def fitted(head: str, job: str | None, rest: Sequence[str]) -> str:
    """The parts joined by "; " in at most MAX_CHARS characters, none cut at its end: the pod's own words whole
    (its node's name already elided past NAME_SHOWN); then the job's words, worded again shorter when a
    reasons.Worded (its names and notes elided, its figure whole); the rest (the comparison, the constraints, the
    notes) keeps at least _REST_FLOOR characters of what is left, unless the job's figure needs them, elided in its
    middle, and is left out when too little is left for it to say anything."""
    text = _SEP.join([head, *([job] if job else []), *rest])
    if len(text) <= MAX_CHARS:
        return text
    tail = _SEP.join(rest)
    if job:
        keep = min(len(tail), _REST_FLOOR) + len(_SEP) if tail else 0
        room = MAX_CHARS - len(head) - len(_SEP) - keep
        if isinstance(job, Worded):
            job = job.within(max(room, min(job.least, MAX_CHARS - len(head) - len(_SEP))))
        else:
            job = elided(job, room)
    if tail:
        room = MAX_CHARS - len(head) - (len(job) + len(_SEP) if job else 0) - len(_SEP)
        tail = elided(tail, room) if room >= _REST_LEAST else ""
    return elided(_SEP.join(p for p in (head, job, tail) if p), MAX_CHARS)


def _comparison(found: Offer | None, known: bool, node: str, gbps: float) -> str:
    if not known:
        return "not ranked by this extender (one feasible node, or it restarted since)"
    if found is None:
        return ""
    if gbps >= found.fastest_gbps - _EPS:
        return (f"the fastest of {found.candidates} candidate nodes" if found.candidates > 1
                else "the only candidate node")
    head = f"fastest offered {found.fastest_gbps:.1f} GB/s on {elided(found.fastest_node, NAME_SHOWN)}"
    if found.kept:
        islands = ", ".join(f"{s}-GPU island ({b:.0f} GB/s)" for s, b in found.kept)
        return f"{head}, passed over to keep its free {islands} for larger pods: few nodes still offer one"
    if found.fastest_score < found.top_score:
        return f"{head}, ranked below a tighter fit that keeps larger free sets whole"
    chosen = elided(node, NAME_SHOWN)
    return f"{head}, ranked first here; kube-scheduler's other scores or a placement since chose {chosen}"
