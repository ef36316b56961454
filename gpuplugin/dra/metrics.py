"""Prometheus metrics of the DRA driver, on the registry the process hands in (never the global one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gputopo.kube.watching import WatchMetrics

PREFIX = "gpuplugin_dra"
PUBLISH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class DraMetrics:
    """Every metric of the DRA driver (prefix `gpuplugin_dra_`), on the registry its process hands in
    (gputopo.metrics.process_registry); a fresh one when none is (tests). Counter names get `_total` appended by
    prometheus-client."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.prepares = Counter(f"{PREFIX}_prepares", "Claims asked to be prepared, by result (ok, repeat, "
                                "error).", ["result"], registry=r)
        self.unprepares = Counter(f"{PREFIX}_unprepares", "Claims asked to be unprepared, by result (ok, "
                                  "unknown, error).", ["result"], registry=r)
        self.released = Counter(f"{PREFIX}_released_claims", "Prepared claims released without an unprepare: "
                                "their ResourceClaim is gone (deleted, or recreated with another uid).", registry=r)
        self.undecided = Gauge(f"{PREFIX}_undecided_claims", "Prepared claims whose ResourceClaim the last "
                               "reconcile pass could not look up (kept, their GPUs held).", registry=r)
        self.publishes = Counter(f"{PREFIX}_publishes", "Pool publications that wrote, by mode (in_place, "
                                 "generation).", ["mode"], registry=r)
        self.publish_failures = Counter(f"{PREFIX}_publish_failures", "Pool publications that failed.",
                                        registry=r)
        self.publish_seconds = Histogram(f"{PREFIX}_publish_seconds", "Time to bring the pool up to date.",
                                         buckets=PUBLISH_BUCKETS, registry=r)
        self.health_transitions = Counter(f"{PREFIX}_health_transitions", "GPU health changes, by new state.",
                                          ["to"], registry=r)
        self.consumable_capacity = Gauge(f"{PREFIX}_consumable_capacity", "1 while shared GPUs are published as "
                                         "multi-allocatable devices with a capacity (KEP-5075), 0 otherwise.",
                                         registry=r)
        self.capacity_refusals = Counter(f"{PREFIX}_capacity_refusals", "Publications of shared GPUs the apiserver "
                                         "did not take, by reason (invalid: 422; dropped: stored without "
                                         "allowMultipleAllocations or request policies).", ["reason"], registry=r)
        self.watch = WatchMetrics(r, PREFIX)
