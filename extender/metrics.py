"""Prometheus metrics of one extender instance, in its own registry (tests run several in one process)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

VERBS = ("filter", "prioritize", "bind", "preempt")
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_EFFICIENCY_BUCKETS = (0.1, 0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
_GBPS_BUCKETS = (5, 10, 20, 40, 80, 120, 160, 240, 320, 400, 800)


class ExtenderMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("gpu_extender_requests_total", "Extender HTTP requests by verb and HTTP status.",
                                ["verb", "code"], registry=r)
        self.latency = Histogram("gpu_extender_request_seconds", "Time to answer an extender verb.", ["verb"],
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.filter_nodes = Counter("gpu_extender_filter_nodes_total",
                                    "Nodes judged by filter: passed, failed or unresolvable.", ["result"], registry=r)
        self.binds = Counter("gpu_extender_bind_total", "Bind outcomes.", ["outcome"], registry=r)
        self.plan_efficiency = Histogram(
            "gpu_extender_plan_efficiency",
            "Placement efficiency of bound plans: their all-reduce / the best for their size on the empty node.",
            buckets=_EFFICIENCY_BUCKETS, registry=r)
        self.plan_gbps = Histogram("gpu_extender_plan_allreduce_gbps", "Estimated all-reduce GB/s of bound plans.",
                                   buckets=_GBPS_BUCKETS, registry=r)
        self.reservations_ended = Counter("gpu_extender_reservations_ended_total",
                                          "Reservations that ended, by why.", ["why"], registry=r)
        self.reservations = Gauge("gpu_extender_reservations", "GPU reservations of in-flight plans.", registry=r)
        self.nodes = Gauge("gpu_extender_cache_nodes", "Nodes in the cache.", registry=r)
        self.nodes_without_topology = Gauge("gpu_extender_cache_nodes_without_topology",
                                            "Cached nodes that publish no usable topology.", registry=r)
        self.pods = Gauge("gpu_extender_cache_pods", "GPU pods in the cache.", registry=r)
        self.bad_requests = Counter("gpu_extender_bad_requests_total", "Requests answered 400/413, by verb.",
                                    ["verb"], registry=r)
        self.internal_errors = Counter("gpu_extender_internal_errors_total",
                                       "Unexpected exceptions answered with Error, by verb.", ["verb"], registry=r)

    def bind_gauges(self, reservations: Callable[[], float], nodes: Callable[[], float],
                    nodes_without_topology: Callable[[], float], pods: Callable[[], float]) -> None:
        """Gauges read at scrape time, so the hot path never updates them."""
        self.reservations.set_function(reservations)
        self.nodes.set_function(nodes)
        self.nodes_without_topology.set_function(nodes_without_topology)
        self.pods.set_function(pods)

    def exposition(self) -> bytes:
        """This instance's metrics plus the process-wide ones (kube watch counters, runtime)."""
        return generate_latest(self.registry) + generate_latest(REGISTRY)
