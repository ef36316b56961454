"""Which GPU pods the node cache holds for each job: job key -> pod uids, kept by the cache on every pod event.

The job plans (extender.jobs.plans) read a job's members from it (bound pods with their plans, pending ones with
their GPU counts) and learn from it when a job is gone: its last pod left the cache (deleted, or finished).
"""

from __future__ import annotations

import threading


class JobIndex:
    def __init__(self) -> None:
        self._jobs: dict[str, set[str]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._jobs)

    def move(self, uid: str, old: str | None, new: str | None) -> str | None:
        """Record that pod `uid` belongs to job `new` (None: to none) where it belonged to `old`. Returns `old` when
        that job has no pod left."""
        if old == new:
            return None
        with self._lock:
            if new is not None:
                self._jobs.setdefault(new, set()).add(uid)
            if old is None:
                return None
            uids = self._jobs.get(old)
            if uids is None:
                return None
            uids.discard(uid)
            if uids:
                return None
            del self._jobs[old]
            return old

    def uids(self, key: str) -> list[str]:
        with self._lock:
            return sorted(self._jobs.get(key, ()))
