"""`gpuplugin run`: the device plugin process (discovery, gRPC server, registration, health, metrics, publication).

Exit codes: 0 after SIGTERM/SIGINT, 2 for invalid settings (the message names the field and its source), 1 when the
plugin cannot start (no topology, no NVML, cannot serve its socket).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import structlog

from gpuplugin.config import ConfigError, PluginConfig, load_config
from gputopo.discovery.nics import attach_nics
from gputopo.logs import configure_logging

log = structlog.get_logger("gpuplugin.run")


class StartupError(Exception):
    """The plugin cannot start; the message says why and what to do."""


@dataclass
class Discovered:
    topology: Any
    minors: dict[int, int] = field(default_factory=dict)
    nvml_indices: dict[int, int] = field(default_factory=dict)
    backend: Any = None  # the live NVML backend, for the health monitor


def discover(cfg: PluginConfig) -> Discovered:
    """The node's topology: from --topology, else live NVML (imported lazily: a topology file needs no driver)."""
    if cfg.topology is not None:
        from gputopo.core.errors import CoreError
        from gputopo.discovery.loader import load_topology_file

        try:
            return Discovered(load_topology_file(cfg.topology))
        except CoreError as e:
            raise StartupError(f"cannot load topology: {e}") from None
    try:
        from gputopo.discovery.nvml import DiscoveryError, discover_node
        from gputopo.discovery.nvml_backend import LiveNvmlBackend, NvmlError
    except ImportError as e:
        raise StartupError(f"NVML discovery is unavailable ({e}); pass --topology FILE to run without NVML") from None
    backend = LiveNvmlBackend()
    try:
        backend.init()
    except NvmlError as e:
        raise StartupError(
            f"cannot initialise NVML: {e}. Is the NVIDIA driver installed and visible in this container? "
            "(--topology FILE runs without NVML)"
        ) from None
    try:
        node = discover_node(backend)
    except (DiscoveryError, NvmlError) as e:
        backend.shutdown()
        raise StartupError(f"NVML discovery failed: {e}") from None
    for gone in node.excluded:
        log.warning("gpu left out", nvml_index=gone.nvml_index, uuid=gone.uuid, reason=gone.reason)
    return Discovered(
        attach_nics(node.topology),  # NVML lists no NICs: they come from the PCI tree
        minors={i: d.minor for i, d in enumerate(node.devices) if d.minor is not None},
        nvml_indices={i: d.nvml_index for i, d in enumerate(node.devices)},
        backend=backend,
    )


def start_health(cfg: PluginConfig, found: Discovered, manager: Any) -> Any:
    """The NVML health monitor feeding manager.set_health, or None without NVML (a topology file)."""
    if found.backend is None:
        log.info("health monitoring off: no NVML (running on a topology file)")
        return None
    from gpuplugin.health import HealthMonitor

    kwargs: dict[str, Any] = {}
    if cfg.ignored_xids is not None:
        kwargs["ignored_xids"] = cfg.ignored_xids
    if cfg.health_probe_interval is not None:
        kwargs["probe_interval_s"] = cfg.health_probe_interval
    if cfg.health_recovery is not None:
        kwargs["recovery_s"] = None if cfg.health_recovery == "never" else cfg.health_recovery
    devices = {d.nvml_index: d.id for d in manager.devices}
    monitor = HealthMonitor(found.backend, devices, manager.set_health, **kwargs)
    monitor.start()
    log.info("health monitoring on", gpus=len(devices))
    return monitor


def no_cluster_reason(cfg: PluginConfig) -> str | None:
    """Why this plugin will not talk to the Kubernetes API (publication and plans), or None when it will."""
    if cfg.publish is False:
        return "--no-publish"
    from gputopo.kube.client import credentials_available

    if not credentials_available():
        return "no Kubernetes credentials"
    if not cfg.node_name:
        return "no node name (set --node-name or NODE_NAME)"
    return None


def start_publication(cfg: PluginConfig, manager: Any) -> Any:
    """The node publisher when publication is wanted and possible; otherwise say once why it is off."""
    reason = no_cluster_reason(cfg)
    if reason is not None:
        # credentials without a node name is a misconfiguration; the other reasons are choices
        (log.warning if reason.startswith("no node name") else log.info)(f"publication off: {reason}")
        return None
    from gpuplugin.publisher import start_publisher

    return start_publisher(cfg, manager)


def run_plugin(cfg: PluginConfig, stop: threading.Event, on_ready: Callable[[], None] | None = None) -> None:
    """Run until `stop` is set, then shut everything down in reverse order. Raises StartupError."""
    from gpuplugin.deviceplugin.errors import DevicePluginError
    from gpuplugin.deviceplugin.lifecycle import PluginRunner
    from gpuplugin.deviceplugin.resource import ResourceManager
    from gpuplugin.metrics import MetricsServer, PluginMetrics

    found = discover(cfg)
    metrics = PluginMetrics()
    cleanup: list[Callable[[], None]] = []
    if found.backend is not None:
        cleanup.append(found.backend.shutdown)
    try:
        try:
            manager = ResourceManager(
                found.topology,
                id_strategy=cfg.device_id_strategy,
                list_strategy=cfg.device_list_strategy,
                keys=cfg.keys,
                dev_root=cfg.dev_root,
                minors=found.minors,
                nvml_indices=found.nvml_indices,
                metrics=metrics,
            )
            cleanup.append(manager.close)
            runner = PluginRunner(manager, cfg.device_plugin_dir, cfg.resource_name, cfg.socket_name).start()
        except DevicePluginError as e:
            raise StartupError(str(e)) from None
        cleanup.append(runner.stop)
        log.info(
            "device plugin started",
            resource=cfg.resource_name,
            socket=str(runner.socket_path),
            gpus=len(manager.devices),
            fabric=found.topology.fabric,
        )
        threading.Thread(target=manager.prewarm, name="allocator-prewarm", daemon=True).start()
        monitor = start_health(cfg, found, manager)
        if monitor is not None:
            cleanup.append(monitor.stop)
        if cfg.metrics_port:
            try:
                server = MetricsServer(metrics.registry, runner.ready, cfg.metrics_port).start()
            except OSError as e:
                raise StartupError(f"cannot serve metrics on port {cfg.metrics_port}: {e.strerror or e}") from None
            cleanup.append(server.stop)
            log.info("metrics on", port=server.port)
        publisher = start_publication(cfg, manager)
        if publisher is not None and hasattr(publisher, "stop"):
            cleanup.append(publisher.stop)
        plans = start_plan_watch(cfg, manager)
        if plans is not None:
            cleanup.append(plans)
        if on_ready is not None:
            on_ready()
        stop.wait()
        log.info("shutting down")
    finally:
        for fn in reversed(cleanup):
            try:
                fn()
            except Exception:
                log.exception("shutdown step failed", step=getattr(fn, "__qualname__", repr(fn)))


def start_plan_watch(cfg: PluginConfig, manager: Any) -> Callable[[], None] | None:
    """Plans from the scheduler extender: a watch on this node's pods feeding GetPreferredAllocation. Returns the
    function that stops it, or None (said once) when there is no cluster to watch; the plugin then answers with its
    own best subset, which on the same free set is the extender's choice anyway."""
    reason = no_cluster_reason(cfg)
    if reason is not None:
        log.info("plans from the extender off", reason=reason)
        return None
    from gputopo.kube.client import KubeConfigError, make_api_client

    try:
        api = make_api_client()
    except KubeConfigError as e:
        log.warning("plans from the extender off", reason=str(e))
        return None
    from gpuplugin.plan_watch import PlanWatch

    watch = PlanWatch(api, cfg.node_name, keys=cfg.keys,
                      resource_name=cfg.resource_name).start()
    manager.set_plan_source(watch)
    log.info("plans from the extender on", node=cfg.node_name)

    def stop() -> None:
        manager.set_plan_source(None)
        watch.stop()
        api.close()

    return stop


_HELP_ENV = "Env GPUPLUGIN_<FLAG>; YAML --config key <flag>."


@click.command("run", epilog=f"Every setting: flag > environment > config file > default. {_HELP_ENV}")
@click.option("--config", "config_file", type=click.Path(path_type=Path), envvar="GPUPLUGIN_CONFIG", help="YAML file.")
@click.option("--device-plugin-dir", help="Kubelet device plugin directory [/var/lib/kubelet/device-plugins].")
@click.option("--resource-name", help="Extended resource name [nvidia.com/gpu].")
@click.option("--topology", help="Topology file (nvidia-smi topo -m text, NVML recording, compact JSON): no NVML.")
@click.option("--device-list-strategy", help="envvar | cdi [envvar].")
@click.option("--device-id-strategy", help="uuid | index [uuid].")
@click.option("--node-name", help="This node's name (env NODE_NAME too).")
@click.option("--pod-resources-socket", help="Kubelet PodResources socket.")
@click.option("--metrics-port", help="Port for /metrics and /healthz; 0 = off [8080].")
@click.option("--annotation-prefix", help="Prefix of node and pod annotations [gpu-topology.io].")
@click.option("--publish/--no-publish", default=None, help="Publish topology to the Node [auto: with credentials].")
@click.option("--socket-name", help="Our socket's file name in the plugin directory [gpu-topology.sock].")
@click.option("--dev-root", help="Where the host's /dev is visible, to find device nodes [/].")
@click.option("--log-level", help="debug | info | warning | error [info].")
@click.option("--ignored-xids", help="Comma-separated Xids that do not mark a GPU unhealthy [13,31,43,45,68,109].")
@click.option("--health-probe-interval", help="Seconds between health probes of each GPU.")
@click.option("--health-recovery", help="Seconds of passing probes before an unhealthy GPU is healthy again, or never.")
@click.option("--print-config", is_flag=True, help="Print the resolved settings as JSON and exit.")
def command(config_file: Path | None, print_config: bool, **flags: Any) -> None:
    """Serve the GPUs to the kubelet as a topology-aware device plugin."""
    try:
        cfg = load_config(flags, config_file=config_file)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    if print_config:
        click.echo(cfg.model_dump_json(indent=2))
        return
    configure_logging(cfg.log_level)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal received", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        run_plugin(cfg, stop)
    except StartupError as e:
        log.error("cannot start", error=str(e))
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)
