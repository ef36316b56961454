"""Prometheus metrics of the webhook process, on the registry it hands in (prefix `gpu_extender_`: the webhook is
a subcommand of gpu-extender; its series carry `webhook` in their names, the listener's are extender.http.server's)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from extender.webhook.review import OUTCOMES

PREFIX = "gpu_extender"
_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)


class WebhookMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.reviews = Counter(f"{PREFIX}_webhook_reviews_total",
                               "Admission reviews answered, by outcome (patched: schedulerName set).", ["outcome"],
                               registry=r)
        for outcome in OUTCOMES:
            self.reviews.labels(outcome)
        self.bad_requests = Counter(f"{PREFIX}_webhook_bad_requests_total",
                                    "Requests answered 400/413 (not an AdmissionReview, too large).", registry=r)
        self.latency = Histogram(f"{PREFIX}_webhook_review_seconds", "Time to answer an admission review.",
                                 buckets=_LATENCY_BUCKETS, registry=r)
        self.certificate_reloads = Counter(f"{PREFIX}_webhook_certificate_reloads_total",
                                           "Serving certificate reloads, by result (done, failed).", ["result"],
                                           registry=r)
        self.http_connections = Gauge(f"{PREFIX}_http_connections", "Client connections open now, by listener.",
                                      ["listener"], registry=r)
        self.http_connections_closed = Counter(
            f"{PREFIX}_http_connections_closed_total",
            "Connections the server closed, by listener and why: head_timeout, body_timeout, evicted, refused.",
            ["listener", "reason"], registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
