"""Prioritize answers worked out right after their pod's filter answer went out, before kube-scheduler asks.

kube-scheduler sends a pod's /prioritize with exactly the nodes its /filter passed, after running its own score
plugins; the extender sits idle in that gap, and the scheduling cycle waits on every millisecond of prioritize
(issue 24). So once filter has answered, the scores for (pod uid, need, the passed nodes) are computed in a worker
thread (extender.verbs starts it and makes a prioritize that arrives meanwhile wait for it) and kept; prioritize
with the same pod and nodes takes them instead of computing them, provided no node's placement state
changed meanwhile (the states are interned, so an unchanged node has the very same state object: the check is a
C-level list comparison). Anything else (other nodes, a changed node, a pod never filtered) is computed as before.

Preparing costs what computing costs, so it pays only when the answers are taken: while fewer than half of the last
WINDOW prepared answers were (a client that sends prioritize other nodes than filter passed, or none), only every
PROBE_EVERY-th filter prepares one, to notice when they are taken again.

A score only ranks nodes: bind still chooses the GPUs under the node's lock from the state it sees then, so an answer
taken here can never plan a GPU twice. Kept for the last few pods only (one scheduling cycle runs at a time per
scheduler profile).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from extender.placement.engine import Placement
from extender.placement.explain import Offer
from extender.placement.memo import need_key
from extender.state.pods import Need

PREPARED_LIMIT = 8
WINDOW = 32  # the last prepared answers whose use decides whether to go on preparing
MIN_TAKEN = 0.5
PROBE_EVERY = 16
PREPARED, CHANGED, COMPUTED = "prepared", "changed", "computed"  # where a prioritize answer came from

Key = tuple[str, Any]


class PreparedScores:
    def __init__(self, placement: Placement, count: Callable[[str], None], done: Callable[[], None],
                 limit: int = PREPARED_LIMIT) -> None:
        """`count(source)` is told where each answer asked for came from (PREPARED, CHANGED or COMPUTED), `done()`
        of each answer prepared."""
        self.placement = placement
        self.limit = limit
        self._count = count
        self._done = done
        self._ready: OrderedDict[Key, tuple[list[str], list[Any], list[int], Offer | None, list[bool]]] = (
            OrderedDict())
        self._lock = threading.Lock()
        self._recent: deque[list[bool]] = deque(maxlen=WINDOW)  # per prepared answer: [taken]
        self._declined = 0

    def worth_preparing(self) -> bool:
        """Whether to prepare the next answer: yes while at least MIN_TAKEN of the recent ones were taken (or too
        few were prepared to tell), else once every PROBE_EVERY filters."""
        with self._lock:
            recent = list(self._recent)
        if len(recent) < WINDOW // 4 or sum(t[0] for t in recent) >= MIN_TAKEN * len(recent):
            return True
        self._declined += 1
        return self._declined % PROBE_EVERY == 0

    def prepare(self, uid: str, names: list[str], need: Need) -> None:
        """Compute and keep prioritize's answer for this pod over these nodes (nodes known to the cache only). Runs
        in a worker thread: the node states it reads are the ones its scores are computed from."""
        states = list(map(self.placement.cache.states.get, names))
        scores, offer = self.placement.score_offer(names, need, states=states)
        taken = [False]
        with self._lock:
            self._ready[(uid, need_key(need))] = (names, states, scores, offer, taken)
            self._recent.append(taken)
            while len(self._ready) > self.limit:
                self._ready.popitem(last=False)
        self._done()

    def take(self, uid: str, names: list[str], need: Need) -> tuple[list[int], Offer | None] | None:
        """The prepared (scores, offer) if this pod's answer over exactly these nodes was prepared and none of the
        nodes changed since; None otherwise. An answer is taken once."""
        with self._lock:
            hit = self._ready.pop((uid, need_key(need)), None)
        if hit is None or hit[0] != names:  # list equality: C-level, cheaper than hashing thousands of names
            self._count(COMPUTED)
            return None
        _, states, scores, offer, taken = hit
        taken[0] = True  # the client asked for exactly this: worth preparing, even if a node changed meanwhile
        if list(map(self.placement.cache.states.get, names)) != states:
            self._count(CHANGED)
            return None
        self._count(PREPARED)
        return scores, offer
