"""The messages between the state process and the answering process, over one unix socket pair.

A frame is a 4-byte big-endian length and a pickle. Both ends are this program: the state process creates the pair
and starts the other end with it, so nothing outside can write a frame (pickle is safe here, and carries the
topologies and pod needs as the objects they are). A frame above MAX_FRAME ends the channel rather than be read.

State process to answering process:
- ("config", ExtenderConfig): first, once;
- ("states", {node: state key or None}, {fingerprint: Topology}, mig names or None, shared names or None): the node
  states that changed (None: the node is gone), the topologies they refer to that were not sent before, and the
  resource-name sets when they changed;
- ("ready",): the node cache holds a full snapshot: answer from the copy from now on;
- ("leading", bool): whether this replica may answer at all (leader election: only the Lease holder does; always
  true without election): first, and again on every change; while false every verb is passed on;
- ("reply", id, status, headers, body): the answer to a passed-on request.
Answering process to state process:
- ("call", id, scope, body): a request passed on whole (scope: the ASGI scope's plain fields);
- ("told", [op, ...]): what the local answers leave for binds and metrics, in order: ("recent", PodNeeds),
  ("offer", uid, Offer or None), ("metric", attribute, labels, method, value).
"""

from __future__ import annotations

import asyncio
import pickle
from typing import Any

MAX_FRAME = 64 << 20
_HEADER = 4


class ChannelClosed(Exception):
    """The other process went away (end of file), or sent a frame this end refuses."""


def frame(message: tuple[Any, ...]) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > MAX_FRAME:
        raise ValueError(f"a {message[0]!r} message of {len(data)} bytes exceeds the channel's {MAX_FRAME}")
    return len(data).to_bytes(_HEADER, "big") + data


def _size(header: bytes) -> int:
    size = int.from_bytes(header, "big")
    if size > MAX_FRAME:
        raise ChannelClosed(f"frame of {size} bytes announced, above {MAX_FRAME}")
    return size


def _message(data: bytes) -> tuple[Any, ...]:
    message = pickle.loads(data)
    if not isinstance(message, tuple) or not message or not isinstance(message[0], str):
        raise ChannelClosed(f"not a message: {type(message).__name__}")
    return message


async def read_message(reader: asyncio.StreamReader) -> tuple[Any, ...]:
    try:
        return _message(await reader.readexactly(_size(await reader.readexactly(_HEADER))))
    except (asyncio.IncompleteReadError, ConnectionError) as e:
        raise ChannelClosed(f"channel closed: {type(e).__name__}") from None


def read_first(sock: Any) -> tuple[Any, ...]:
    """The first message, read blocking before the answering process has an event loop (its config)."""
    def exactly(n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = sock.recv(left)
            if not chunk:
                raise ChannelClosed("channel closed before the first message")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    return _message(exactly(_size(exactly(_HEADER))))


class _Child:
    """One labelled series: its updates are summed (counters, gauges) or listed (histograms) until drained, so a
    flush carries one op per series, not one per update: applying ops one by one (a labels() lookup each) was a
    quarter of the state process's loop under load (issue 24)."""

    __slots__ = ("added", "labels", "observed", "taken")

    def __init__(self, labels: tuple[str, ...]) -> None:
        self.labels = labels
        self.added = self.taken = 0.0
        self.observed: list[float] = []

    def inc(self, amount: float = 1.0) -> None:
        self.added += amount

    def dec(self, amount: float = 1.0) -> None:
        self.taken += amount

    def observe(self, amount: float) -> None:
        self.observed.append(amount)


class _Family:
    __slots__ = ("children",)

    def __init__(self) -> None:
        self.children: dict[tuple[str, ...], _Child] = {}

    def labels(self, *labels: str) -> _Child:
        child = self.children.get(labels)
        if child is None:
            child = self.children[labels] = _Child(labels)
        return child


class RelayedMetrics:
    """The answering process's metrics: updates are kept per series and `drain` turns them into ops for the state
    process, where ExtenderMetrics (the one registry) applies them (apply_op). Only the families the answering
    process updates (the verbs' and its listener's) exist here."""

    FAMILIES = ("requests", "latency", "answered_apart", "filter_nodes", "bad_requests", "internal_errors",
                "http_connections", "http_connections_closed")
    METHODS = ("inc", "dec", "observe_all")

    def __init__(self) -> None:
        for attr in self.FAMILIES:
            setattr(self, attr, _Family())

    def drain(self, ops: list[tuple[Any, ...]]) -> None:
        """Append ("metric", family, labels, method, value) per series updated since the last drain."""
        for attr in self.FAMILIES:
            family: _Family = getattr(self, attr)
            for child in family.children.values():
                if child.added:
                    ops.append(("metric", attr, child.labels, "inc", child.added))
                    child.added = 0.0
                if child.taken:
                    ops.append(("metric", attr, child.labels, "dec", child.taken))
                    child.taken = 0.0
                if child.observed:
                    ops.append(("metric", attr, child.labels, "observe_all", child.observed))
                    child.observed = []

    @staticmethod
    def apply_op(metrics: Any, op: tuple[Any, ...]) -> None:
        """One drained op on the state process's ExtenderMetrics; anything else raises (the caller logs it)."""
        _, attr, labels, method, value = op
        if attr not in RelayedMetrics.FAMILIES or method not in RelayedMetrics.METHODS:
            raise ValueError(f"no relayed metric {attr}.{method}")
        child = getattr(metrics, attr).labels(*labels)
        if method == "observe_all":
            for v in value:
                child.observe(v)
        else:
            getattr(child, method)(value)
