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
from extender.state.cache import PlacementState
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
            else:
                st = self._interned.get(key)
                if st is None:
                    st = self._interned[key] = PlacementState(key)
                self.states[name] = st
            for forget in self.on_state_change:
                forget(name)
