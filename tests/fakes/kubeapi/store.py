"""Objects by resource, one resourceVersion counter for all of them, and the history of changes that watches replay.

Everything runs under one re-entrant condition: each change notifies it, so waits are event driven.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from tests.fakes.kubeapi.objects import Obj, clone, with_rv
from tests.fakes.kubeapi.patches import merge_patch
from tests.fakes.kubeapi.status import ApiError, not_found


class Event(NamedTuple):
    """One change, as a watch replays it: the object after it and, for MODIFIED and DELETED, before."""

    rv: int
    resource: str
    type: str
    obj: Obj
    old: Obj | None


class Store:
    """The storage layer of the fake: see the module docstring. Subclasses serve it over HTTP."""

    def __init__(self, *, history_limit: int = 10_000, first_rv: int = 100) -> None:
        self.history_limit = history_limit
        self._cond = threading.Condition(threading.RLock())
        self._rv = first_rv
        self._store: dict[str, dict[str, Obj]] = {}  # resource -> key -> object; each API group adds its resources
        self._history: deque[Event] = deque()
        self._trimmed_upto = 0  # highest rv dropped from history
        self._compacted_upto = 0  # expire_history(): watches/continues from older rvs get 410
        self._stopping = threading.Event()  # set by stop(): open watches and held requests end

    @property
    def resource_version(self) -> str:
        with self._cond:
            return str(self._rv)

    def wait_until(self, predicate: Callable[[], bool], timeout: float = 5.0) -> bool:
        """Block until predicate() (evaluated under the fake's lock, re-checked on every change) is true."""
        with self._cond:
            return self._cond.wait_for(predicate, timeout)

    # -- store internals (call with or without the lock; RLock) ----------------------------------------------

    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    def _record(self, resource: str, event_type: str, obj: Obj, old: Obj | None) -> None:
        self._history.append(Event(int(obj["metadata"]["resourceVersion"]), resource, event_type, obj, old))
        while len(self._history) > self.history_limit:
            self._trimmed_upto = self._history.popleft().rv
        self._cond.notify_all()

    def _put(self, resource: str, key: str, new: Obj, old: Obj) -> Obj:
        new = with_rv(new, self._next_rv())
        self._store[resource][key] = new
        self._record(resource, "MODIFIED", new, old)
        return new

    def _update(self, resource: str, key: str, change: Obj | Callable[[Obj], Obj | None]) -> Obj:
        with self._cond:
            old = self._store[resource].get(key)
            if old is None:
                raise KeyError(f"{resource} {key} not found")
            if callable(change):
                work = clone(old)
                result = change(work)
                new = result if isinstance(result, dict) else work
            else:
                new = merge_patch(old, change)
            if new == old:
                return old
            return self._put(resource, key, new, old)

    def _delete(self, resource: str, key: str) -> Obj:
        with self._cond:
            old = self._store[resource].pop(key, None)
            if old is None:
                raise KeyError(f"{resource} {key} not found")
            gone = with_rv(old, self._next_rv())
            self._record(resource, "DELETED", gone, old)
            return gone

    def _get(self, resource: str, key: str, name: str) -> Obj:
        with self._cond:
            obj = self._store[resource].get(key)
        if obj is None:
            raise ApiError(not_found(resource, name))
        return obj
