"""Prometheus metrics of one extender instance, on the registry its process hands in (prefix `gpu_extender_`).

Tests and benchmarks run several extenders in one process; each gets a registry of its own."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gputopo.core.efficiency import DEFINITIONS, VS_EMPTY
from gputopo.kube.watching import WatchMetrics

VERBS = ("filter", "prioritize", "bind", "preempt")
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_EFFICIENCY_BUCKETS = (0.1, 0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
PREFIX = "gpu_extender"
_GB = 1e9
# 256 B to 16 MiB by fours: a /filter of a nodeCacheCapable scheduler carries the pod and node names (kilobytes to
# tens of kilobytes at 5,000 nodes); one without nodeCacheCapable carries whole Node objects (megabytes)
_BODY_BUCKETS = tuple(float(256 * 4 ** k) for k in range(9))
_BANDWIDTH_BUCKETS = tuple(g * _GB for g in (5, 10, 20, 40, 80, 120, 160, 240, 320, 400, 800))


class ExtenderMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_requests_total", "Extender HTTP requests by verb and HTTP status.",
                                ["verb", "code"], registry=r)
        self.latency = Histogram(f"{PREFIX}_request_seconds", "Time to answer an extender verb.", ["verb"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.request_bytes = Histogram(f"{PREFIX}_request_body_bytes",
                                       "Size of a verb's request body as read, in bytes, by verb.", ["verb"],
                                       buckets=_BODY_BUCKETS, registry=r)
        self.response_bytes = Histogram(f"{PREFIX}_response_body_bytes",
                                        "Size of a verb's answer body as written, in bytes, by verb.", ["verb"],
                                        buckets=_BODY_BUCKETS, registry=r)
        self.filter_nodes = Counter(f"{PREFIX}_filter_nodes_total",
                                    "Nodes judged by filter: passed, failed or unresolvable.", ["result"], registry=r)
        self.binds = Counter(f"{PREFIX}_bind_total", "Bind outcomes.", ["outcome"], registry=r)
        self.plan_efficiency = Histogram(
            f"{PREFIX}_plan_efficiency_ratio",
            f"{VS_EMPTY.capitalize()} of bound plans: {DEFINITIONS[VS_EMPTY]}.",
            buckets=_EFFICIENCY_BUCKETS, registry=r)
        self.plan_bandwidth = Histogram(f"{PREFIX}_plan_allreduce_bytes_per_second",
                                        "Estimated all-reduce bandwidth of bound plans, bytes per second.",
                                        buckets=_BANDWIDTH_BUCKETS, registry=r)
        self.reservations_ended = Counter(f"{PREFIX}_reservations_ended_total",
                                          "Reservations that ended, by why.", ["why"], registry=r)
        self.reservations = Gauge(f"{PREFIX}_reservations", "GPU reservations of in-flight plans.", registry=r)
        self.nodes = Gauge(f"{PREFIX}_cache_nodes", "Nodes in the cache.", registry=r)
        self.nodes_without_topology = Gauge(f"{PREFIX}_cache_nodes_without_topology",
                                            "Cached nodes that publish no usable topology.", registry=r)
        self.pods = Gauge(f"{PREFIX}_cache_pods", "GPU pods in the cache.", registry=r)
        self.bad_requests = Counter(f"{PREFIX}_bad_requests_total", "Requests answered 400/413, by verb.",
                                    ["verb"], registry=r)
        self.internal_errors = Counter(f"{PREFIX}_internal_errors_total",
                                       "Unexpected exceptions answered with Error, by verb.", ["verb"], registry=r)
        self.http_connections = Gauge(f"{PREFIX}_http_connections", "Client connections open now, by listener.",
                                      ["listener"], registry=r)
        self.http_connections_closed = Counter(
            f"{PREFIX}_http_connections_closed_total",
            "Connections the server closed, by listener and why: head_timeout, body_timeout, evicted (the cap was "
            "reached and it waited longest for a request), refused (the cap was reached, none could be evicted).",
            ["listener", "reason"], registry=r)
        self.job_plans = Counter(f"{PREFIX}_job_plans_total",
                                 "Job plans made at a job pod's filter, by outcome: planned (its slots reserved), "
                                 "unplaceable (fits nowhere now), bad_job.", ["outcome"], registry=r)
        self.job_plan_seconds = Histogram(f"{PREFIX}_job_plan_seconds", "Time to plan a job (extender.jobs.planner).",
                                          buckets=_LATENCY_BUCKETS, registry=r)
        self.leader = Gauge(f"{PREFIX}_leader", "1 while this replica answers the verbs: it holds the leader "
                            "election Lease, or runs without election; 0 on a standby.", registry=r)
        self.leader.set(1)
        self.requeued = Counter(f"{PREFIX}_requeued_pods_total",
                                "Refused pods touched so kube-scheduler retries them after a hold ended by time "
                                "(extender.requeue), by outcome: touched, gone, failed.", ["outcome"], registry=r)
        self.job_slots = Gauge(f"{PREFIX}_job_slots", "Reserved slots of job plans no pod has taken yet.", registry=r)
        self.watch = WatchMetrics(r, PREFIX)

    def bind_gauges(self, reservations: Callable[[], float], nodes: Callable[[], float],
                    nodes_without_topology: Callable[[], float], pods: Callable[[], float]) -> None:
        """Gauges read at scrape time, so the hot path never updates them."""
        self.reservations.set_function(reservations)
        self.nodes.set_function(nodes)
        self.nodes_without_topology.set_function(nodes_without_topology)
        self.pods.set_function(pods)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
