"""`gpuplugin dra`: the node agent as a DRA driver (the DaemonSet's DRA mode; the device plugin is `run`).

Discovery as in `run`, then: the device catalog, the prepared-claims state, the slice publisher (official client,
in-cluster or KUBECONFIG), the gRPC server on the kubelet's plugin registry, NVML Xid health when NVML is there,
and /metrics + /healthz on the process's one registry. Settings: gpuplugin.dra.settings (flag > environment
GPUPLUGIN_DRA_<FLAG> > YAML --config > default; NODE_NAME also gives the node name).

Exit codes: 0 after SIGTERM/SIGINT, 2 for invalid settings, a missing or unreadable file among them (the message
names the setting and its source), 1 when the driver cannot start.
"""

from __future__ import annotations

import sys
import threading

import click
import structlog

from gpuplugin.dra.settings import SETTINGS, DraSettings
from gputopo.logs import configure_logging
from gputopo.workers import Teardown, stop_on_signals

log = structlog.get_logger("gpuplugin.dra")


class StartupError(Exception):
    """The driver cannot start; the message says why."""


def run_driver(settings: DraSettings, stop: threading.Event) -> None:
    from gpuplugin.commands.run import StartupError as DiscoveryError
    from gpuplugin.commands.run import discover
    from gpuplugin.dra.catalog import Catalog, CatalogError
    from gpuplugin.dra.cdi import CdiWriter
    from gpuplugin.dra.driver import Driver
    from gpuplugin.dra.errors import DraError
    from gpuplugin.dra.metrics import DraMetrics
    from gpuplugin.dra.pool import PoolPlanner
    from gpuplugin.dra.publisher import SlicePublisher
    from gpuplugin.dra.server import DraServer
    from gpuplugin.dra.state import StateFile
    from gpuplugin.metrics import MetricsServer
    from gputopo.kube import KubeConfigError, make_api_client
    from gputopo.kube.dra import get_claim
    from gputopo.metrics import process_registry

    try:
        found = discover(settings.topology)
    except DiscoveryError as e:
        raise StartupError(str(e)) from None
    with Teardown("gpuplugin dra") as teardown:
        if found.backend is not None:
            teardown.undo(found.backend.shutdown)
        try:
            api = make_api_client()
        except KubeConfigError as e:
            raise StartupError(f"a DRA driver needs the Kubernetes API: {e}") from None
        teardown.undo(api.close)
        state = StateFile(settings.state_dir / "state.json")
        try:
            held = {d.device for c in state.load().values() for d in c.devices}
            catalog = Catalog.build(found.topology, settings.set_sizes, settings.max_devices, keep=held)
        except (CatalogError, DraError) as e:
            raise StartupError(str(e)) from None
        log.info("dra.catalog.built", summary=catalog.summary())
        metrics = DraMetrics(process_registry())
        publisher_box: list[SlicePublisher] = []
        try:
            driver = Driver(catalog, driver_name=settings.driver_name, pool=settings.node, state=state,
                            cdi=CdiWriter(settings.cdi_dir, settings.driver_name),
                            get_claim=lambda ns, name: get_claim(api, ns, name), minors=found.minors,
                            nvidia_cdi=settings.nvidia_cdi, metrics=metrics,
                            on_change=lambda: publisher_box[0].request() if publisher_box else None)
        except DraError as e:
            raise StartupError(str(e)) from None
        publisher = SlicePublisher(api, PoolPlanner(catalog, taint_key=settings.taint_key,
                                                    republish=settings.republish),
                                   lambda: (driver.used_gpus(), driver.unhealthy_gpus()),
                                   driver=settings.driver_name, node=settings.node, metrics=metrics,
                                   min_interval_s=settings.min_publish_interval_s,
                                   watch_claims=settings.republish)
        publisher_box.append(publisher)
        publisher.start()
        teardown.undo(publisher.stop)
        try:
            server = DraServer(driver, settings.registry_dir, settings.state_dir, health=settings.health).start()
        except DraError as e:
            raise StartupError(str(e)) from None
        teardown.undo(server.stop)
        if found.backend is not None:
            from gpuplugin.health import HealthMonitor

            monitor = HealthMonitor(found.backend, {found.nvml_indices.get(g.index, g.index): g.id
                                                    for g in found.topology.gpus},
                                    lambda ids, healthy: driver.set_health(ids, healthy))
            monitor.start()
            teardown.undo(monitor.stop)
        if settings.metrics_port:
            try:
                metrics_server = MetricsServer(metrics.registry, server.ready, settings.metrics_port).start()
            except OSError as e:
                raise StartupError(f"cannot serve metrics on port {settings.metrics_port}: {e}") from None
            teardown.undo(metrics_server.stop)
        log.info("dra.driver.started", driver=settings.driver_name, node=settings.node,
                 gpus=found.topology.size)
        stop.wait()


@click.command("dra", epilog=SETTINGS.epilog)
@SETTINGS.command
def command(settings: DraSettings) -> None:
    """Serve the GPUs to the kubelet as a DRA driver (resource.k8s.io/v1)."""
    configure_logging(settings.log_level)
    stop = stop_on_signals("gpuplugin dra")
    try:
        run_driver(settings, stop)
    except StartupError as e:
        log.error("dra.start.failed", error=str(e))
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)
