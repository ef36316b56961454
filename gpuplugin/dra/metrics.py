"""Prometheus metrics of the DRA driver, on the registry the process hands in (never the global one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

PUBLISH_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class DraMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.prepares = Counter("gpuplugin_dra_prepares", "Claims asked to be prepared, by result (ok, repeat, "
                                "error).", ["result"], registry=r)
        self.unprepares = Counter("gpuplugin_dra_unprepares", "Claims asked to be unprepared, by result (ok, "
                                  "unknown, error).", ["result"], registry=r)
        self.publishes = Counter("gpuplugin_dra_publishes", "Pool publications that wrote, by mode (in_place, "
                                 "generation).", ["mode"], registry=r)
        self.publish_failures = Counter("gpuplugin_dra_publish_failures", "Pool publications that failed.",
                                        registry=r)
        self.publish_seconds = Histogram("gpuplugin_dra_publish_seconds", "Time to bring the pool up to date.",
                                         buckets=PUBLISH_BUCKETS, registry=r)
        self.health_transitions = Counter("gpuplugin_dra_health_transitions", "GPU health changes, by new state.",
                                          ["to"], registry=r)
