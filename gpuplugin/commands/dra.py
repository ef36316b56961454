"""`gpuplugin dra`: the node agent as a DRA driver (the DaemonSet's DRA mode; the device plugin is `run`).

Discovery as in `run`, then: the sharing layout (the device plugin's config file, chosen by the node label read
once at start), the device catalog (whole GPUs and sets, shared GPUs, MIG instances: gpuplugin.dra.partitions),
the prepared-claims state and its reconciler (claims whose ResourceClaim is gone are released, at start and every
--reconcile-interval), the slice publisher (official client, in-cluster or KUBECONFIG), the gRPC server on the
kubelet's plugin registry, one MPS control daemon per MPS-shared set, NVML Xid health when NVML is there, and
/metrics + /healthz on the process's one registry. Settings: gpuplugin.dra.settings (flag > environment
GPUPLUGIN_DRA_<FLAG> > YAML --config > default; NODE_NAME also gives the node name).

Exit codes: 0 after SIGTERM/SIGINT, 2 for invalid settings, a missing or unreadable file among them (the message
names the setting and its source), 1 when the driver cannot start.
"""

from __future__ import annotations

import functools
import sys
import threading
from typing import Any

import click
import structlog

from gpuplugin.dra.settings import SETTINGS, DraSettings
from gputopo.logs import configure_logging
from gputopo.workers import Teardown, stop_on_signals

log = structlog.get_logger("gpuplugin.dra")
WHOLE_RESOURCE = "nvidia.com/gpu"  # the resource NVIDIA's sharing configs name (`resources[].name`)


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
    from gpuplugin.dra.partitions import gpus_to_share, mig_devices, mps_shares, shared_devices
    from gpuplugin.dra.pool import PoolPlanner
    from gpuplugin.dra.publisher import SlicePublisher
    from gpuplugin.dra.reconcile import ClaimReconciler, Reconciler
    from gpuplugin.dra.server import DraServer
    from gpuplugin.dra.state import StateFile
    from gpuplugin.metrics import MetricsServer
    from gpuplugin.sharing.mps import MpsDaemon
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
        layout = sharing_layout(settings, api, found.topology)
        try:
            held = {d.device for c in state.load().values() for d in c.devices}
            to_share, deferred = gpus_to_share(layout, held) if settings.consumable_capacity else ({}, [])
            if deferred:
                log.warning("dra.sharing.deferred", gpus=deferred, why="prepared claims hold them whole; they are "
                            "shared once the driver starts after those claims end")
            shared = [d for d in shared_devices(found.topology, layout) if d.gpus[0] in to_share]
            migs, skipped = mig_devices(found.mig) if settings.mig else ([], [])
            for why in skipped:
                log.warning("dra.mig.left_out", why=why)
            build = functools.partial(Catalog.build, found.topology, settings.set_sizes, settings.max_devices,
                                      keep=held)
            catalog = build(exclude=to_share, extra=[*shared, *migs])
            fallback = build(extra=migs) if shared else None
        except (CatalogError, DraError) as e:
            raise StartupError(str(e)) from None
        log.info("dra.catalog.built", summary=catalog.summary())
        metrics = DraMetrics(process_registry())
        publisher_box: list[SlicePublisher] = []
        mps = mps_shares(found.topology, layout, to_share, settings.mps_root)
        try:
            driver = Driver(catalog, driver_name=settings.driver_name, pool=settings.node, state=state,
                            cdi=CdiWriter(settings.cdi_dir, settings.driver_name),
                            get_claim=lambda ns, name: get_claim(api, ns, name), minors=found.minors,
                            nvidia_cdi=settings.nvidia_cdi, metrics=metrics, mps=mps,
                            on_change=lambda: publisher_box[0].request() if publisher_box else None)
        except DraError as e:
            raise StartupError(str(e)) from None
        for share in {id(s): s for s in mps.values()}.values():
            uuids = [g.uuid for g in share.gpus]
            daemon = MpsDaemon(share, lambda ok, uuids=uuids: driver.set_health(
                uuids, ok, "the MPS control daemon does not answer"), command=(settings.mps_control,))
            daemon.start()
            teardown.undo(daemon.stop)
        publisher = SlicePublisher(api, PoolPlanner(catalog, taint_key=settings.taint_key,
                                                    republish=settings.republish, fallback=fallback,
                                                    on_fallback=driver.use_catalog,
                                                    sick_devices=driver.sick_devices),
                                   lambda: (driver.used_gpus(), driver.unhealthy_gpus()),
                                   driver=settings.driver_name, node=settings.node, metrics=metrics,
                                   min_interval_s=settings.min_publish_interval_s,
                                   watch_claims=settings.republish)
        publisher_box.append(publisher)
        publisher.start()
        teardown.undo(publisher.stop)
        reconciler = ClaimReconciler(Reconciler(driver), interval_s=settings.reconcile_interval_s).start()
        teardown.undo(reconciler.stop)
        try:
            server = DraServer(driver, settings.registry_dir, settings.state_dir, health=settings.health).start()
        except DraError as e:
            raise StartupError(str(e)) from None
        teardown.undo(server.stop)
        if found.backend is not None:
            from gpuplugin.health import HealthMonitor, MigInstanceWatch

            instances = [MigInstanceWatch(m.nvml_index, d.gpu_instance_id, d.compute_instance_id, d.uuid)
                         for m in found.mig if m.enabled for d in m.devices
                         if any(x.uuid == d.uuid for x in catalog.devices.values())]
            monitor = HealthMonitor(found.backend, {found.nvml_indices.get(g.index, g.index): g.id
                                                    for g in found.topology.gpus},
                                    lambda ids, healthy: driver.set_health(ids, healthy), mig_instances=instances,
                                    on_instance_change=lambda uuids, healthy: driver.set_instance_health(
                                        uuids, healthy))
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


def sharing_layout(settings: DraSettings, api: Any, topology: Any) -> Any:
    """The sharing layout this node's config asks for (gpuplugin.sharing), the node label read once; whole GPUs
    when there is no config, and when the config cannot be served (said as an error: the driver still serves the
    GPUs whole, as the device plugin keeps its last good layout)."""
    from gpuplugin.sharing.config import SharingConfigError, choose_config, read_config
    from gpuplugin.sharing.layout import resolve, whole_layout
    from gputopo.kube import get_node
    from gputopo.kube.errors import KubeApiError

    if settings.sharing_config_dir is None:
        return whole_layout(topology)
    label = None
    try:
        label = ((get_node(api, settings.node).get("metadata") or {}).get("labels") or {}).get(
            settings.sharing_config_label)
    except KubeApiError as e:
        log.warning("dra.sharing.label_unreadable", node=settings.node, error=str(e), consequence="default config")
    try:
        choice = choose_config(settings.sharing_config_dir, label, settings.sharing_config_default)
        if choice.path is None:
            return whole_layout(topology)
        layout = resolve(read_config(choice.path), topology, WHOLE_RESOURCE)
    except SharingConfigError as e:
        log.error("dra.sharing.config_refused", error=str(e), consequence="every GPU is published whole")
        return whole_layout(topology)
    log.info("dra.sharing.layout", config=choice.name, why=choice.why,
             shared={s.name: [list(s.gpus), s.strategy] for s in layout.shared})
    return layout


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
