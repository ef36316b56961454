"""The process's one Prometheus registry: each binary makes it once at start and hands it to every component.

Components never register on prometheus-client's global registry, so a test or benchmark can run several plugins
or extenders in one process and read each one's figures, and /metrics shows exactly what its process registered.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector


def process_registry() -> CollectorRegistry:
    """A fresh registry with the runtime's own series (CPU, memory, open fds, GC, Python version)."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)
    return registry
