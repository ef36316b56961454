"""The all-reduce bandwidth of a job of many pods: one estimate for planning, benchmarks and reasons.

A job's collective is a ring over its pods; its estimate is the ring's slowest edge, in GB/s per direction like
every pair figure of the bandwidth table:
- inside a pod, the pod's own best ring (`allreduce_gbps` of its GPUs; a 1-GPU pod has none);
- between two pods on one node, the host path (bandwidth.HOST_PATH_GBPS): each pod sees only its own GPUs, so
  CUDA IPC is impossible and NCCL goes through host shared memory;
- between nodes, the slower of the two GPUs at the edge's ends, each at its NIC path (Topology.network_gbps: line
  rate with GPUDirect RDMA, staged through host memory otherwise), times the factor of every locality level the
  edge crosses (gputopo.core.locality).

Which ring: the best one in which the pods of one node are adjacent (NCCL's inter-node rings pass through a node's
local ranks before leaving it) and every locality domain is visited in one piece, so the ring crosses each domain
boundary twice. Edges are counted independently (no contention), so a ring leaving a rack and coming back would
look as good while loading the rack's oversubscribed uplinks twice as much: such rings are not admitted. A node's
ring enters at one pod and leaves at another when it holds several, each end taking the pod's best-connected GPU:
its best-connected pod faces the harder of its two edges, its second the other. The estimate is the largest
bottleneck over every such ring, found exactly: for a threshold t, whether a ring with every edge >= t exists is
decided on the tree of locality domains (each domain's children in some order, its two ends on children that reach
far enough), and t is searched over the finite set of values an edge can take. The property tests hold it equal to
exhaustive search over domain-contiguous node orders and end pods.

Not modelled: several pods of a node sharing one NIC, NCCL trees and multiple channels, NVLink across nodes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from gputopo.core import bandwidth
from gputopo.core.allocator import allreduce_gbps
from gputopo.core.errors import CoreError
from gputopo.core.locality import Locality, Place
from gputopo.core.topology import Topology

_EPS = 1e-9
_RING_MEMO_LIMIT = 100_000
_RINGS: dict[tuple[str, tuple[int, ...]], float] = {}


class JobModelError(CoreError):
    """Pods that cannot form one job's placement (a GPU twice, one node described two ways, no pods)."""


class Limit(StrEnum):
    """What sets a job's estimate."""

    NONE = "no collective"  # a single GPU in all
    POD_RING = "pod ring"
    HOST_PATH = "host path"
    NETWORK = "network"


@dataclass(frozen=True, slots=True)
class PodSlot:
    """One pod of a job: its node (name, topology, locality) and its GPU indices there."""

    node: str
    topo: Topology
    gpus: tuple[int, ...]
    place: Place

    @property
    def network_gbps(self) -> float:
        """The pod's best GPU-to-network rate: the ring leaves and enters the pod through that GPU."""
        return max(self.topo.network_gbps[g] for g in self.gpus)


@dataclass(frozen=True, slots=True)
class JobEstimate:
    gbps: float
    limit: Limit
    nodes: int
    split: int  # outermost locality level the job's nodes differ at; -1 when they share every level (or one node)


@dataclass(frozen=True, slots=True)
class _Node:
    rates: tuple[float, float]  # best and second-best pod network rate (equal for a node with one pod)
    place: Place


@dataclass(slots=True)
class _Domain:
    level: int  # children differ at this level (-1: children are nodes)
    children: list[_Domain | _Node]


def job_allreduce_gbps(pods: Sequence[PodSlot], locality: Locality) -> JobEstimate:
    """The job's estimated all-reduce GB/s and what limits it. Raises JobModelError on inconsistent pods."""
    if not pods:
        raise JobModelError("a job needs at least one pod")
    nodes = _group(pods, len(locality.levels))
    total = sum(len(p.gpus) for p in pods)
    split = _span(nodes, locality)
    if total <= 1:
        return JobEstimate(0.0, Limit.NONE, len(nodes), split)
    best, limit = math.inf, Limit.NONE
    for p in pods:
        if len(p.gpus) >= 2:
            ring = pod_ring_gbps(p.topo, p.gpus)
            if ring < best:
                best, limit = ring, Limit.POD_RING
    if any(len(members) >= 2 for members in nodes.values()) and best > bandwidth.HOST_PATH_GBPS:
        best, limit = bandwidth.HOST_PATH_GBPS, Limit.HOST_PATH
    if len(nodes) >= 2:
        net = _network_bottleneck([_node_of(members) for members in nodes.values()], locality)
        if net < best:
            best, limit = net, Limit.NETWORK
    return JobEstimate(best, limit, len(nodes), split)


def pod_ring_gbps(topo: Topology, gpus: tuple[int, ...]) -> float:
    """`allreduce_gbps` of a pod, memoised: a planner weighs the same pods in many candidate placements."""
    key = (topo.fingerprint, gpus)
    hit = _RINGS.get(key)
    if hit is None:
        hit = allreduce_gbps(topo, gpus)
        if len(_RINGS) >= _RING_MEMO_LIMIT:
            _RINGS.clear()
        _RINGS[key] = hit
    return hit


def _network_bottleneck(nodes: Sequence[_Node], locality: Locality) -> float:
    """The best ring's slowest inter-node edge over nodes given by their two end rates and their places."""
    root = _tree(list(nodes), len(locality.levels) - 1)
    factors = [locality.factor(i) for i in range(-1, len(locality.levels))]
    candidates = sorted({r * f for n in nodes for r in n.rates for f in factors}, reverse=True)
    lo, hi = 0, len(candidates) - 1  # find the first (largest) feasible candidate; the smallest always is
    while lo < hi:
        mid = (lo + hi) // 2
        if _ring_exists(root, candidates[mid], locality):
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo] if _ring_exists(root, candidates[lo], locality) else 0.0


def _node_rates(pod_rates: Sequence[float]) -> tuple[float, float]:
    """A node's two ring ends: its best pod faces the harder edge, the second-best the other."""
    ordered = sorted(pod_rates, reverse=True)
    return (ordered[0], ordered[1] if len(ordered) > 1 else ordered[0])


def _group(pods: Sequence[PodSlot], levels: int) -> dict[str, list[PodSlot]]:
    nodes: dict[str, list[PodSlot]] = {}
    for p in pods:
        if not p.gpus:
            raise JobModelError(f"a pod on {p.node} has no GPUs")
        if any(not 0 <= g < p.topo.size for g in p.gpus) or len(set(p.gpus)) != len(p.gpus):
            raise JobModelError(f"pod GPUs {list(p.gpus)} are not distinct GPUs of node {p.node}")
        if len(p.place) != levels:
            raise JobModelError(f"node {p.node} has a place of {len(p.place)} levels, the locality has {levels}")
        members = nodes.setdefault(p.node, [])
        same_topo = not members or members[0].topo is p.topo or members[0].topo == p.topo
        if members and (not same_topo or members[0].place != p.place):
            raise JobModelError(f"node {p.node} is described two ways by pods of one job")
        members.append(p)
    for name, members in nodes.items():
        seen: set[int] = set()
        for p in members:
            if seen & set(p.gpus):
                raise JobModelError(f"two pods of the job share GPU {sorted(seen & set(p.gpus))[0]} on {name}")
            seen.update(p.gpus)
    return nodes


def _node_of(members: Sequence[PodSlot]) -> _Node:
    return _Node(_node_rates([p.network_gbps for p in members]), members[0].place)


def _span(nodes: dict[str, list[PodSlot]], locality: Locality) -> int:
    places = [members[0].place for members in nodes.values()]
    return max((locality.split(places[0], q) for q in places[1:]), default=-1)


def _tree(nodes: list[_Node], level: int) -> _Domain:
    if level < 0:
        return _Domain(-1, list(nodes))
    groups: dict[str | None, list[_Node]] = {}
    for n in nodes:
        groups.setdefault(n.place[level], []).append(n)
    return _Domain(level, [_tree(g, level - 1) for g in groups.values()])


def _ring_exists(root: _Domain, t: float, locality: Locality) -> bool:
    d: _Domain | _Node = root
    while isinstance(d, _Domain) and len(d.children) == 1:
        d = d.children[0]
    if not isinstance(d, _Domain):
        return True  # one node: no inter-node edge
    f = locality.factor(d.level)
    return all(_path(c, f, f, t, locality) for c in d.children)


def _path(d: _Domain | _Node, fa: float, fb: float, t: float, locality: Locality) -> bool:
    """Whether `d` can be traversed in one piece with its two outer edges keeping factors fa and fb (<= every
    factor inside it) and every edge >= t."""
    if isinstance(d, _Node):
        hi, lo = d.rates
        return hi * min(fa, fb) >= t - _EPS and lo * max(fa, fb) >= t - _EPS
    if len(d.children) == 1:
        return _path(d.children[0], fa, fb, t, locality)
    f = locality.factor(d.level)
    if not all(_path(c, f, f, t, locality) for c in d.children):
        return False
    first = [i for i, c in enumerate(d.children) if _path(c, fa, f, t, locality)]
    last = [i for i, c in enumerate(d.children) if _path(c, f, fb, t, locality)]
    return bool(first) and bool(last) and not (len(first) == 1 and first == last)
