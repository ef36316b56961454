"""Where the first pod of a job of unknown size may go: not onto a node another such job is growing on.

A job whose size nothing tells (no owner read, no annotation, no group) is planned one pod at a time, each near the
ones placed. Its first pod, planned alone, would go where it fits best: the fullest node, which is where the first
pod of the previous unknown job went too. Four jobs' first workers filled one node, and their siblings had to go
elsewhere or nowhere (issue 21: 4 of 12 jobs left partly bound, holding 24 GPUs no one could use). So the first pod
of such a job goes, in this order of preference:

1. to a node no other open job of unknown size holds anything on, with room for it to grow (twice its GPUs free);
2. to a node such jobs hold pods on, where room stays for every job there to double what it holds, the new one
   included (the fewest such jobs, then the most GPUs free);
3. to a node no such job holds, with room for the pod alone;
4. nowhere yet: every node with room is where jobs of unknown size are still growing. The pod waits (its reason
   says so) rather than start a job that would take the GPUs those jobs need next and be left partly bound itself.

An open job is one of unknown size placed or planned within the reservation timeout: the horizon after which its
slots end and it is forgotten, so a job that stopped growing stops holding nodes back. Jobs of known size are
planned whole and need none of this; a job's later pods are planned near its earlier ones by the planner.

Pure: the job plans (extender.jobs.plans) give it the claims and the snapshot.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from extender.jobs.planner import NodeSnapshot


@dataclass(frozen=True, slots=True)
class Claims:
    """What other open jobs of unknown size hold, per node: how many jobs, how many GPUs (pods and slots)."""

    jobs: Counter[str] = field(default_factory=Counter)
    gpus: Counter[str] = field(default_factory=Counter)
    count: int = 0  # open jobs holding anything

    @classmethod
    def of(cls, held_per_job: Iterable[Iterable[tuple[str, int]]]) -> Claims:
        """From each open job's (node, GPUs) pods and slots."""
        jobs: Counter[str] = Counter()
        gpus: Counter[str] = Counter()
        count = 0
        for held in held_per_job:
            nodes = set()
            for node, n in held:
                gpus[node] += n
                nodes.add(node)
            jobs.update(nodes)
            count += bool(nodes)
        return cls(jobs, gpus, count)


def first_pod_nodes(snaps: Sequence[NodeSnapshot], claims: Claims, k: int) -> list[NodeSnapshot]:
    """The nodes a first pod of k GPUs may be planned on (the module's order); empty when it must wait."""
    roomy = [s for s in snaps if s.free.bit_count() >= k]
    if not claims.jobs:
        return list(snaps)
    free = [s for s in roomy if not claims.jobs.get(s.name)]
    grow = [s for s in free if s.free.bit_count() >= 2 * k]
    if grow:
        return grow
    shared = [s for s in roomy if claims.jobs.get(s.name) and s.free.bit_count() - k >= k + claims.gpus[s.name]]
    if shared:
        fewest = min(claims.jobs[s.name] for s in shared)
        shared = [s for s in shared if claims.jobs[s.name] == fewest]
        most = max(s.free.bit_count() for s in shared)
        return [s for s in shared if s.free.bit_count() == most]
    return free
