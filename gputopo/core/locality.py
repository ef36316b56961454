"""Where a node sits in the network, read from node labels: an ordered list of levels, innermost first.

Each level (rack, spine, core, zone) is read from the first of its label keys a node carries, so one list serves
clusters labelled by different tools. Two nodes are split at the outermost level where their values differ; a ring
edge between them crosses that level and every level inside it (leaving a spine means leaving the rack first), and
keeps the product of those levels' factors of the bandwidth (bandwidth.DEFAULT_LEVEL_FACTOR per level unless
configured). A node without a level's label has the value None there; two unlabelled nodes count as together, so
a cluster without any label is one flat network.

Default keys (checked against the publishers' documentation):
- NVIDIA topograph: network.topology.nvidia.com/leaf, /spine, /core (docs.nvidia.com/topograph, engines/kubernetes);
  releases up to v0.1.0 wrote /block and /datacenter for the first and last tier (NVIDIA/topograph docs/k8s.md).
- GKE: cloud.google.com/gce-topology-subblock (a rack; on A4X one NVL72 domain) inside
  cloud.google.com/gce-topology-block (GKE "reserved block" docs; Kueue TAS examples).
- EKS: topology.k8s.aws/network-node-layer-1 (top) .. -3 (bottom for most instance types; docs.aws.amazon.com/eks
  ml-workload-topology). Types with a fourth layer also carry -4 below -3: add a level for it if you run them.
- topology.kubernetes.io/zone (Kubernetes well-known label).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gputopo.core.bandwidth import DEFAULT_LEVEL_FACTOR
from gputopo.core.errors import CoreError

Place = tuple[str | None, ...]  # a node's value at each level, innermost first

MAX_LEVELS = 8
_KEY_RE = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,30}$")


class LocalityError(CoreError):
    """A locality configuration that cannot be used; the message names the level or key."""


@dataclass(frozen=True, slots=True)
class Level:
    """One network tier: its name for humans, the label keys that carry it (first present wins), and the share of
    bandwidth a ring edge keeps when it crosses this tier."""

    name: str
    keys: tuple[str, ...]
    factor: float = DEFAULT_LEVEL_FACTOR

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise LocalityError(f"level name {self.name!r} must be 1-31 lowercase letters, digits or '-'")
        if not self.keys:
            raise LocalityError(f"level {self.name} needs at least one label key")
        for key in self.keys:
            if len(key) > 316 or not _KEY_RE.match(key):
                raise LocalityError(f"level {self.name}: {key[:64]!r} is not a label key")
        f = self.factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or not 0 < f <= 1:
            raise LocalityError(f"level {self.name}: factor must be in (0, 1], got {f!r}")


DEFAULT_LEVELS: tuple[Level, ...] = (
    Level("rack", (
        "network.topology.nvidia.com/leaf",
        "network.topology.nvidia.com/block",
        "cloud.google.com/gce-topology-subblock",
        "topology.k8s.aws/network-node-layer-3",
    )),
    Level("spine", (
        "network.topology.nvidia.com/spine",
        "cloud.google.com/gce-topology-block",
        "topology.k8s.aws/network-node-layer-2",
    )),
    Level("core", (
        "network.topology.nvidia.com/core",
        "network.topology.nvidia.com/datacenter",
        "topology.k8s.aws/network-node-layer-1",
    )),
    Level("zone", ("topology.kubernetes.io/zone",)),
)


@dataclass(frozen=True)
class Locality:
    levels: tuple[Level, ...] = DEFAULT_LEVELS

    def __post_init__(self) -> None:
        if not 0 < len(self.levels) <= MAX_LEVELS:
            raise LocalityError(f"1-{MAX_LEVELS} locality levels, got {len(self.levels)}")
        names = [lv.name for lv in self.levels]
        if len(set(names)) != len(names):
            raise LocalityError(f"level names repeat: {', '.join(names)}")
        # factor(split) for split = -1 (same innermost domain) .. len-1, computed once
        products = [1.0]
        for lv in self.levels:
            products.append(products[-1] * lv.factor)
        object.__setattr__(self, "_factors", tuple(products))

    def place(self, labels: Mapping[str, Any] | None) -> Place:
        """The node's value at each level (None where it has none of the level's keys, or a non-string value)."""
        labels = labels or {}
        out: list[str | None] = []
        for lv in self.levels:
            value = None
            for key in lv.keys:
                v = labels.get(key)
                if isinstance(v, str) and v:
                    value = v
                    break
            out.append(value)
        return tuple(out)

    def split(self, a: Place, b: Place) -> int:
        """The outermost level at which two places differ, or -1 when they share every level."""
        for i in range(len(self.levels) - 1, -1, -1):
            if a[i] != b[i]:
                return i
        return -1

    def factor(self, split: int) -> float:
        """Share of bandwidth kept by an edge between nodes split at `split` (1.0 for -1)."""
        return self._factors[split + 1]  # type: ignore[attr-defined,no-any-return]

    def where(self, split: int, place: Place) -> str:
        """'rack r12' (the domain a job split at `split` stays inside), or 'the cluster' when none holds it."""
        for i in range(split + 1, len(self.levels)):
            if place[i] is not None:
                return f"{self.levels[i].name} {place[i]}"
        return "the cluster"


def parse_locality(spec: str) -> Locality:
    """Levels from 'rack=key|key@0.5,spine=key@0.5,zone=key', innermost first; the factor defaults per level."""
    levels: list[Level] = []
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise LocalityError("empty locality specification")
    for part in parts:
        name, eq, rest = part.partition("=")
        if not eq:
            raise LocalityError(f"{part[:64]!r}: expected name=key|key[@factor]")
        keys, at, factor_text = rest.partition("@")
        factor = DEFAULT_LEVEL_FACTOR
        if at:
            try:
                factor = float(factor_text)
            except ValueError:
                raise LocalityError(f"level {name.strip()}: factor {factor_text[:32]!r} is not a number") from None
        levels.append(Level(name.strip(), tuple(k.strip() for k in keys.split("|") if k.strip()), factor))
    return Locality(tuple(levels))

