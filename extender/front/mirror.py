"""The answering process's copy of the node states: what extender.placement.engine reads of the node cache to
answer whole-GPU filter and prioritize, kept as the state process streams it (extender.front.channel).

Node states arrive as their keys (extender.state.cache.state_key: fingerprint, free, total, used, unhealthy and
reserved masks, or why the node is unusable), so the reservations of binds in flight are in them. Equal keys are one
PlacementState here too: the placement memo hashes states by identity. Each change forgets the node's answers kept by
name (on_state_change), as NodeCache does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from extender.config import ExtenderConfig
from extender.state.cache import UNUSABLE, PlacementState
from gputopo.core import Topology

INTERNED_LIMIT = 200_000  # distinct state keys kept interned; past it, only the current ones are kept


class MirrorCache:
    def __init__(self, config: ExtenderConfig) -> None:
        self.config = config
        self.states: dict[str, PlacementState] = {}
        self.topologies: dict[str, Topology] = {}
        self.mig_names: frozenset[str] = frozenset()
        self.shared_names: frozenset[str] = frozenset()
        self.on_state_change: list[Callable[[str], None]] = []
        self._interned: dict[tuple[Any, ...], PlacementState] = {}
        self._received: dict[str, tuple[Any, ...]] = {}  # each node's key as the state process last sent it
        self._held: dict[str, dict[int, int]] = {}  # node -> {bind token: GPUs held in its state here}
        self._tokens = 0

    def apply(self, states: Mapping[str, tuple[Any, ...] | None], topologies: Mapping[str, Topology],
              mig_names: frozenset[str] | None, shared_names: frozenset[str] | None) -> None:
        """One ("states", ...) message. Topologies first: a state may name a fingerprint only this message brings."""
        self.topologies.update(topologies)
        if mig_names is not None:
            self.mig_names = mig_names
        if shared_names is not None:
            self.shared_names = shared_names
        if len(self._interned) > INTERNED_LIMIT:
            self._interned = {st.key: st for st in self.states.values()}
        for name, key in states.items():
            if key is None:
                self.states.pop(name, None)
                self._received.pop(name, None)
                self._held.pop(name, None)
            else:
                self._received[name] = key
                self._show(name)
            self._changed(name)

    def hold(self, name: str, mask: int) -> int | None:
        """Count GPUs (`mask`, free here) as reserved on the node while a bind passed on to the state process is
        on its way there, so a filter answered meanwhile does not offer them again. A hold lasts until release,
        whatever the state process says of the node meanwhile: a state sent before the bind's reservation was made
        (another bind's, a watch event's) would otherwise end it too early. Over a state that already has the
        reservation it changes nothing (those GPUs are not free there). The token to release it with, or None
        (nothing to hold)."""
        st = self.states.get(name)
        if st is None or st.problem is not None or not mask or mask & ~st.free:
            return None
        self._tokens += 1
        self._held.setdefault(name, {})[self._tokens] = mask
        self._show(name)
        self._changed(name)
        return self._tokens

    def release(self, name: str, token: int) -> None:
        """The bind was answered: its reservation, if made, is in what the state process said by then (its state
        goes before its reply on the channel)."""
        holds = self._held.get(name)
        if holds is None or holds.pop(token, None) is None:
            return
        if not holds:
            del self._held[name]
        self._show(name)
        self._changed(name)

    def _show(self, name: str) -> None:
        """The node's state as the state process said it, less the GPUs held for binds on their way."""
        key = self._received[name]
        held = 0
        for mask in self._held.get(name, {}).values():
            held |= mask
        if held and key[0] != UNUSABLE:
            fingerprint, free, total, used, unhealthy, reserved = key
            key = (fingerprint, free & ~held, total, used, unhealthy, reserved | (free & held))
        st = self._interned.get(key)
        if st is None:
            st = self._interned[key] = PlacementState(key)
        self.states[name] = st

    def _changed(self, name: str) -> None:
        for forget in self.on_state_change:
            forget(name)
