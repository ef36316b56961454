"""`gpuplugin dra`: the node agent as a DRA driver (the DaemonSet's DRA mode; the device plugin is `run`).

Discovery as in `run`, then: the device catalog, the prepared-claims state, the slice publisher (official client,
in-cluster or KUBECONFIG), the gRPC server on the kubelet's plugin registry, NVML Xid health when NVML is there,
and /metrics + /healthz. Options are plain click options mapped 1:1 onto gpuplugin.dra.settings.DraSettings (env
GPUPLUGIN_DRA_<OPTION>), so they can move to the generated settings as they are.

Exit codes: 0 after SIGTERM/SIGINT, 2 for invalid settings, 1 when the driver cannot start.
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import click
import structlog
from pydantic import ValidationError

from gpuplugin.dra.settings import ENV_PREFIX, DraSettings, parse_ints
from gputopo.logs import configure_logging

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

    try:
        found = discover(SimpleNamespace(topology=str(settings.topology) if settings.topology else None))
    except DiscoveryError as e:
        raise StartupError(str(e)) from None
    cleanup: list[Any] = []
    if found.backend is not None:
        cleanup.append(found.backend.shutdown)
    try:
        try:
            api = make_api_client()
        except KubeConfigError as e:
            raise StartupError(f"a DRA driver needs the Kubernetes API: {e}") from None
        cleanup.append(api.close)
        state = StateFile(settings.state_dir / "state.json")
        try:
            held = {d.device for c in state.load().values() for d in c.devices}
            catalog = Catalog.build(found.topology, settings.set_sizes, settings.max_devices, keep=held)
        except (CatalogError, DraError) as e:
            raise StartupError(str(e)) from None
        log.info("dra.catalog.built", summary=catalog.summary())
        metrics = DraMetrics()
        publisher_box: list[SlicePublisher] = []
        try:
            driver = Driver(catalog, driver_name=settings.driver_name, pool=settings.node_name, state=state,
                            cdi=CdiWriter(settings.cdi_dir, settings.driver_name),
                            get_claim=lambda ns, name: get_claim(api, ns, name), minors=found.minors,
                            nvidia_cdi=settings.nvidia_cdi, metrics=metrics,
                            on_change=lambda: publisher_box[0].request() if publisher_box else None)
        except DraError as e:
            raise StartupError(str(e)) from None
        publisher = SlicePublisher(api, PoolPlanner(catalog, taint_key=settings.taint_key,
                                                    republish=settings.republish),
                                   lambda: (driver.used_gpus(), driver.unhealthy_gpus()),
                                   driver=settings.driver_name, node=settings.node_name, metrics=metrics,
                                   min_interval_s=settings.min_publish_interval_s)
        publisher_box.append(publisher)
        publisher.start()
        cleanup.append(publisher.stop)
        try:
            server = DraServer(driver, settings.registry_dir, settings.state_dir, health=settings.health).start()
        except DraError as e:
            raise StartupError(str(e)) from None
        cleanup.append(server.stop)
        if found.backend is not None:
            from gpuplugin.health import HealthMonitor

            monitor = HealthMonitor(found.backend, {found.nvml_indices.get(g.index, g.index): g.id
                                                    for g in found.topology.gpus},
                                    lambda ids, healthy: driver.set_health(ids, healthy))
            monitor.start()
            cleanup.append(monitor.stop)
        if settings.metrics_port:
            try:
                metrics_server = MetricsServer(metrics.registry, server.ready, settings.metrics_port).start()
            except OSError as e:
                raise StartupError(f"cannot serve metrics on port {settings.metrics_port}: {e}") from None
            cleanup.append(metrics_server.stop)
        log.info("dra.driver.started", driver=settings.driver_name, node=settings.node_name,
                 gpus=found.topology.size)
        stop.wait()
    finally:
        for fn in reversed(cleanup):
            try:
                fn()
            except Exception:
                log.exception("dra.shutdown.failed", step=getattr(fn, "__qualname__", repr(fn)))


def _opt(*decls: str, **kwargs: Any) -> Any:
    field = decls[0].lstrip("-").split("/")[0].replace("-", "_")
    kwargs.setdefault("envvar", f"{ENV_PREFIX}{field.upper()}")
    return click.option(*decls, show_envvar=True, **kwargs)


@click.command("dra")
@_opt("--node-name", envvar=["GPUPLUGIN_DRA_NODE_NAME", "NODE_NAME"], help="This node.")
@_opt("--driver-name", default="gpu-topology.io", show_default=True)
@_opt("--topology", type=click.Path(path_type=Path), help="Topology file instead of NVML.")
@_opt("--registry-dir", type=click.Path(path_type=Path), default="/var/lib/kubelet/plugins_registry",
      show_default=True)
@_opt("--plugin-dir", type=click.Path(path_type=Path), help="Sockets and state [/var/lib/kubelet/plugins/<driver>].")
@_opt("--cdi-dir", type=click.Path(path_type=Path), default="/var/run/cdi", show_default=True)
@_opt("--set-sizes", default="2,4,8,16", show_default=True)
@_opt("--max-devices", type=int, default=512, show_default=True)
@_opt("--republish/--static", default=True, show_default=True, help="Reorder after allocation changes.")
@_opt("--min-publish-interval", "min_publish_interval_s", type=float, default=0.2, show_default=True)
@_opt("--health/--no-health", default=True, show_default=True)
@_opt("--nvidia-cdi/--no-nvidia-cdi", default=True, show_default=True)
@_opt("--metrics-port", type=int, default=8080, show_default=True)
@_opt("--log-level", default="info", show_default=True)
@click.option("--print-config", is_flag=True, help="Print the resolved settings as JSON and exit.")
def command(print_config: bool, set_sizes: str, node_name: str | None, **flags: Any) -> None:
    """Serve the GPUs to the kubelet as a DRA driver (resource.k8s.io/v1)."""
    try:
        settings = DraSettings(set_sizes=tuple(parse_ints(set_sizes, "--set-sizes")), node_name=node_name or "",
                               **flags)
    except (ValidationError, ValueError) as e:
        raise click.UsageError(str(e)) from None
    if print_config:
        click.echo(settings.model_dump_json(indent=2))
        return
    configure_logging(settings.log_level)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("dra.signal.received", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        run_driver(settings, stop)
    except StartupError as e:
        log.error("dra.start.failed", error=str(e))
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)
