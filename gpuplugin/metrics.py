"""Prometheus metrics of the device plugin, on one registry, and the HTTP server for /metrics and /healthz.

One registry per plugin instance (not the process-global default) so that tests and benchmarks can run several
plugins in one process and read each one's figures.
"""

from __future__ import annotations

import socketserver
from collections.abc import Callable, Iterable
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from gputopo.kube.watching import WatchMetrics
from gputopo.workers import Worker

PREFIX = "gpuplugin"
# GetPreferredAllocation blocks pod admission; the target is p99 <= 2 ms, so resolve the low end finely.
LATENCY_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)


class PluginMetrics:
    """Every metric the node agent exports, on the registry its process hands in (prefix `gpuplugin_`).
    Counter names get `_total` appended by prometheus-client."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.registrations = Counter(
            f"{PREFIX}_registrations", "Successful registrations with the kubelet.", registry=r
        )
        self.registration_failures = Counter(
            f"{PREFIX}_registration_failures", "Failed registration attempts with the kubelet.", registry=r
        )
        self.server_starts = Counter(
            f"{PREFIX}_server_starts", "Times the gRPC server started serving on its socket.", registry=r
        )
        self.allocations = Counter(
            f"{PREFIX}_allocations", "Allocate container requests, by result (ok, invalid).", ["result"], registry=r
        )
        self.plan_hits = Counter(
            f"{PREFIX}_preferred_plan_hits", "Preferred allocations answered with a scheduler plan.", registry=r
        )
        self.preferred_fallbacks = Counter(
            f"{PREFIX}_preferred_fallbacks",
            "Preferred allocations answered without a plan, by reason.",
            ["reason"],
            registry=r,
        )
        self.preferred_latency = Histogram(
            f"{PREFIX}_preferred_allocation_seconds",
            "Time to answer one GetPreferredAllocation call.",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.health_transitions = Counter(
            f"{PREFIX}_health_transitions", "Device health changes, by new state.", ["to"], registry=r
        )
        self.streams = Gauge(f"{PREFIX}_listandwatch_streams", "ListAndWatch streams open now.", registry=r)
        self.streams_refused = Counter(
            f"{PREFIX}_listandwatch_streams_refused",
            "ListAndWatch streams refused (RESOURCE_EXHAUSTED) because the most allowed were open.",
            registry=r,
        )
        self.devices = Gauge(f"{PREFIX}_devices", "Advertised devices, by health.", ["health"], registry=r)
        # The plan watch (gpuplugin.plan_watch): what GetPreferredAllocation found among the extender's plans.
        self.plan_lookups = Counter(
            f"{PREFIX}_plan_lookups",
            "GetPreferredAllocation questions put to the plan watch: hit, or miss and why.",
            ["result", "reason"],
            registry=r,
        )
        self.kubelet_view_failures = Counter(
            f"{PREFIX}_plan_kubelet_view_failures",
            "PodResources List reads that failed while matching a plan to the pod being admitted (the kubelet's "
            "admission order was followed instead).",
            registry=r,
        )
        self.pending_plans = Gauge(
            f"{PREFIX}_pending_plans", "Pods on this node with a plan the kubelet has not acted on.", registry=r
        )
        self.plans_ignored = Counter(
            f"{PREFIX}_plan_annotations_ignored",
            "Plan annotations on this node's pods that were not used, by reason.",
            ["reason"],
            registry=r,
        )
        self.watch = WatchMetrics(r, PREFIX)


class _ThreadingWSGIServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """Scrapes every few seconds would flood the structured log."""


class MetricsServer(Worker):
    """/metrics (Prometheus text) and /healthz (200 when `ready()` is true, else 503) on one port.

    `port=0` binds an ephemeral port (read it from `.port`); the CLI maps its `--metrics-port 0` to "no server".
    """

    def __init__(self, registry: CollectorRegistry, ready: Callable[[], bool], port: int, host: str = "") -> None:
        super().__init__("metrics-http")
        self._metrics_app = make_wsgi_app(registry)
        self._ready = ready
        self._server = make_server(host, port, self._app, _ThreadingWSGIServer, handler_class=_QuietHandler)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def _app(self, environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            ok = self._ready()
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"ok\n" if ok else b"not serving or not registered\n"]
        if path == "/metrics":
            return self._metrics_app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found\n"]

    def loop(self) -> None:
        self._server.serve_forever(poll_interval=0.1)
        self._server.server_close()

    def interrupt(self) -> None:
        if self.running:
            self._server.shutdown()
        else:
            self._server.server_close()
