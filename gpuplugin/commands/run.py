"""`gpuplugin run`: the device plugin process (discovery, gRPC server, registration, health, metrics, publication).

Exit codes: 0 after SIGTERM/SIGINT, 2 for invalid settings, a missing or unreadable file among them (the message
names the setting and its source), 1 when the plugin cannot start (a topology file it cannot parse, no NVML, cannot
serve its socket, a sharing config directory that is not there).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import structlog

from gpuplugin.config import SETTINGS, PluginConfig
from gputopo.discovery.nics import attach_nics
from gputopo.logs import ProcessOutput, configure_logging
from gputopo.workers import Teardown, stop_on_signals

log = structlog.get_logger("gpuplugin.run")
# After a GPU pod ends, PodResources is followed closely this long, so its release is published as soon as the
# kubelet lets go of its devices (gpuplugin.publisher).
POD_END_FOLLOW_S = 3.0
# How long a starting plugin waits for the plan watch's first list of the node's pods before it serves and registers:
# the kubelet asks for a preference as soon as the plugin registers, and a pod admitted then (one bound while a
# crashed plugin was away) must get its plan. An apiserver that does not answer delays the start no longer than
# this; the watch keeps trying, and plans are honoured once it has listed.
PLAN_SYNC_WAIT_S = 10.0


class StartupError(Exception):
    """The plugin cannot start; the message says why and what to do."""


class NvmlUnavailable(StartupError):
    """NVML cannot be loaded or initialised: no driver or toolkit visible in this container."""


@dataclass
class Discovered:
    topology: Any  # None: every GPU of the node is MIG-enabled (only `run` accepts that: all_mig=True)
    minors: dict[int, int] = field(default_factory=dict)
    nvml_indices: dict[int, int] = field(default_factory=dict)
    backend: Any = None  # the NVML backend (live or a replayed recording), for health and MIG
    mig: tuple[Any, ...] = ()  # gputopo.discovery.nvml_mig.MigGpu of the GPUs with MIG enabled or pending

    @property
    def mig_gpus(self) -> list[tuple[int, str]]:
        """(NVML index, UUID) of the MIG-enabled GPUs: the ones the MIG layout is re-read on."""
        return [(m.nvml_index, m.uuid) for m in self.mig if m.enabled]


def nvml_backend(recording: Path | None) -> Any:
    """The live NVML library, initialised, or a replay of `recording` (re-read when the file changes)."""
    from gputopo.discovery.nvml_backend import LiveNvmlBackend, NvmlError

    if recording is not None:
        from gputopo.core.errors import TopologyParseError
        from gputopo.discovery.recording import RecordingFileBackend

        try:
            replay = RecordingFileBackend(recording)
        except TopologyParseError as e:
            raise StartupError(f"cannot replay NVML: {e}") from None
        replay.init()
        return replay
    backend = LiveNvmlBackend()
    try:
        backend.init()
    except NvmlError as e:
        raise NvmlUnavailable(
            f"cannot initialise NVML: {e}. Is the NVIDIA driver installed and visible in this container? "
            "(--topology FILE runs without NVML)"
        ) from None
    return backend


def discover(topology: Path | None, recording: Path | None = None, *, all_mig: bool = False) -> Discovered:
    """The node's topology: from the `topology` file, else NVML, live or replayed from `recording` (imported
    lazily: a topology file needs no driver). Both node agents (`run`, `dra`) start here. `all_mig`: a node whose
    every GPU is MIG-enabled gives a Discovered without topology instead of failing."""
    if topology is not None:
        from gputopo.core.errors import CoreError
        from gputopo.discovery.loader import load_topology_file

        try:
            return Discovered(load_topology_file(topology))
        except CoreError as e:
            raise StartupError(f"cannot load topology: {e}") from None
    try:
        from gputopo.discovery.nvml import DiscoveryError, discover_node
        from gputopo.discovery.nvml_backend import NvmlError
    except ImportError as e:
        raise NvmlUnavailable(
            f"NVML discovery is unavailable ({e}); pass --topology FILE to run without NVML"
        ) from None
    backend = nvml_backend(recording)
    try:
        node = discover_node(backend)
    except DiscoveryError as e:
        if all_mig and any(m.enabled for m in e.mig):
            log.info("plugin.gpu.all_mig", gpus=len(e.mig), hint="every GPU is MIG-enabled: only MIG devices, as "
                                                                  "--mig-strategy serves them")
            return Discovered(None, backend=backend, mig=e.mig)
        backend.shutdown()
        raise StartupError(f"NVML discovery failed: {e}") from None
    except NvmlError as e:
        backend.shutdown()
        raise StartupError(f"NVML discovery failed: {e}") from None
    for gone in node.excluded:
        log.warning("plugin.gpu.left_out", nvml_index=gone.nvml_index, uuid=gone.uuid, reason=gone.reason)
    return Discovered(
        attach_nics(node.topology),  # NVML lists no NICs: they come from the PCI tree
        minors={i: d.minor for i, d in enumerate(node.devices) if d.minor is not None},
        nvml_indices={i: d.nvml_index for i, d in enumerate(node.devices)},
        backend=backend,
        mig=node.mig,
    )


def start_health(cfg: PluginConfig, found: Discovered, manager: Any, mig: Any = None) -> Any:
    """The NVML health monitor feeding manager.set_health (whole GPUs; `manager` None when there are none) and
    mig.set_instance_health (MIG instances, re-watched after every re-partition), or None without NVML."""
    if found.backend is None:
        log.info("plugin.health.off")
        return None
    from gpuplugin.health import HealthMonitor, MigInstanceWatch

    def watches(instances: Any) -> list[MigInstanceWatch]:
        return [MigInstanceWatch(i.nvml_index, i.device.gpu_instance_id, i.device.compute_instance_id, i.uuid)
                for i in instances]

    served = () if manager is None else (manager.all_devices if hasattr(manager, "all_devices") else manager.devices)
    devices = {d.nvml_index: d.uuid for d in served}
    instances = [i for insts in mig.served().values() for i in insts] if mig is not None else []
    monitor = HealthMonitor(found.backend, devices, manager.set_health if manager is not None else lambda *_: None,
                            ignored_xids=cfg.ignored_xids, probe_interval_s=cfg.health_probe_interval,
                            recovery_s=cfg.health_recovery_s, mig_instances=watches(instances),
                            on_instance_change=mig.set_instance_health if mig is not None else None)
    if mig is not None:
        mig.on_instances = lambda now: monitor.watch_instances(watches(now))
        monitor.watch_instances(watches([i for insts in mig.served().values() for i in insts]))
    monitor.start()
    log.info("plugin.health.on", gpus=len(devices), mig_instances=len(instances))
    return monitor


def start_mig(cfg: PluginConfig, found: Discovered, serve: Callable[..., Any], *, whole_gpus: int,
              read_config: Callable[[], Any], in_use: Callable[[], Any], metrics: Any,
              plans: PlanFeed | None = None) -> Any:
    """The MIG node (gpuplugin.sharing.mig_node) when some GPU is MIG-enabled; None otherwise. It takes the plans
    before it serves (see PlanFeed)."""
    if not found.mig_gpus or found.backend is None:
        return None
    from gpuplugin.sharing.mig_node import MigNode

    mig = MigNode(found.backend, found.mig_gpus, whole_gpus=whole_gpus, whole_resource=cfg.resource_name,
                  whole_socket=cfg.socket_name, serve=serve, strategy=cfg.mig_strategy, read_config=read_config,
                  in_use=in_use, poll_interval_s=cfg.mig_poll_interval,
                  manager_options={"list_strategy": cfg.device_list_strategy, "keys": cfg.keys,
                                   "dev_root": cfg.dev_root, "metrics": metrics})
    if plans is not None:
        plans.attach(mig)
    return mig.start()


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


def start_publication(cfg: PluginConfig, manager: Any, **options: Any) -> Any:
    """The node publisher when publication is wanted and possible; otherwise say once why it is off."""
    reason = no_cluster_reason(cfg)
    if reason is not None:
        # credentials without a node name is a misconfiguration; the other reasons are choices
        (log.warning if reason.startswith("no node name") else log.info)("plugin.publish.off", reason=reason)
        return None
    from gpuplugin.publisher import start_publisher

    return start_publisher(cfg, manager, **options)


def label_reader(cfg: PluginConfig) -> tuple[Callable[[], str | None] | None, Callable[[], None] | None]:
    """Reads this node's sharing config label from the API (and the client's close), or (None, None) without a
    cluster (the default config is served then) or with a single config file (the label chooses among the files
    of a directory only, as NVIDIA's config-manager does)."""
    if cfg.sharing_config_dir is None or no_cluster_reason(cfg) is not None:
        return None, None
    from gputopo.kube.client import KubeConfigError, make_api_client
    from gputopo.kube.fetching import get_node

    try:
        api = make_api_client()
    except KubeConfigError as e:
        log.warning("plugin.sharing.label_off", reason=str(e))
        return None, None
    node_name, key = cfg.node_name or "", cfg.sharing_config_label

    def read() -> str | None:
        labels = (get_node(api, node_name).get("metadata") or {}).get("labels") or {}
        value = labels.get(key)
        return value if isinstance(value, str) and value else None

    return read, api.close


def check_sharing_dir(directory: Path | None) -> None:
    """StartupError when the sharing config directory is not one this process can list: a typo there would serve
    whole GPUs, the team believing them shared, with a warning per pass at most."""
    if directory is None:
        return
    if not directory.is_dir():
        raise StartupError(f"sharing config directory {str(directory)!r} (--sharing-config-dir) does not exist")
    if not os.access(directory, os.R_OK | os.X_OK):
        raise StartupError(f"sharing config directory {str(directory)!r} (--sharing-config-dir) is not readable")


def run_plugin(cfg: PluginConfig, stop: threading.Event, on_ready: Callable[[], None] | None = None) -> None:
    """Run until `stop` is set, then shut everything down in reverse order. Raises StartupError."""
    from gpuplugin.deviceplugin.allocation import ListStrategy
    from gpuplugin.deviceplugin.errors import DevicePluginError
    from gpuplugin.deviceplugin.lifecycle import PluginRunner
    from gpuplugin.deviceplugin.resource import ResourceManager
    from gpuplugin.metrics import MetricsServer, PluginMetrics
    from gpuplugin.podresources import PodResourcesClient
    from gpuplugin.sharing.layout import MigView
    from gpuplugin.sharing.mig_node import config_reader
    from gpuplugin.sharing.node import ConfigSource, SharingNode
    from gputopo.metrics import process_registry

    if cfg.device_list_strategy is ListStrategy.CDI:
        log.warning("plugin.config.deprecated", setting="device_list_strategy", value="cdi", now="cdi-cri",
                    hint="cdi now means cdi-cri (CDI names in the CRI field only); say cdi-cri, or cdi-annotations "
                         "for runtimes that read the cdi.k8s.io/ annotations")
    check_sharing_dir(cfg.sharing_config_dir)
    found = discover(cfg.topology, cfg.nvml_recording, all_mig=True)
    metrics = PluginMetrics(process_registry())
    with Teardown("gpuplugin run") as teardown:
        if found.backend is not None:
            teardown.undo(found.backend.shutdown)
        pods = PodResourcesClient(str(cfg.pod_resources_socket))
        teardown.undo(pods.close)
        read_label, close_label = label_reader(cfg)
        if close_label is not None:
            teardown.undo(close_label)
        source = ConfigSource(cfg.sharing_source, cfg.sharing_config_default, read_label)
        mig_gpus = frozenset(uuid for _, uuid in found.mig_gpus)
        mig: Any = None  # the MIG node, once started; the sharing layout's MIG + MPS check reads it

        def serve(m: ResourceManager, resource: str, socket: str) -> PluginRunner:
            return PluginRunner(m, cfg.device_plugin_dir, resource, socket).start()

        def mig_view() -> MigView:
            return mig.view() if mig is not None else MigView({}, mig_gpus)

        node: Any = None
        # Listed before anything serves: the kubelet's first question after a (re)start may be for a planned pod.
        plans = open_plan_watch(cfg, metrics, stop, shared=lambda: [
            *(node.shared_names() if node is not None else ()), *(mig.resource_names() if mig is not None else ())])
        if plans is not None:
            teardown.undo(plans.stop)
        try:
            if found.topology is not None:
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
                teardown.undo(manager.close)
                node = SharingNode(
                    manager, cfg.resource_name, cfg.socket_name, serve, source,
                    in_use=pods.in_use, mps_root=cfg.mps_root, mps_command=(cfg.mps_control,),
                    poll_interval_s=cfg.sharing_poll_interval, mig_view=mig_view,
                    mps_daemons=cfg.mps_daemons, mps_interval_s=cfg.mps_probe_interval,
                )
                if plans is not None:
                    plans.attach(node)
                node.start()
                teardown.undo(node.stop)
            mig = start_mig(cfg, found, serve, whole_gpus=0 if found.topology is None else found.topology.size,
                            read_config=(lambda: node.config) if node is not None else config_reader(source),
                            in_use=pods.in_use, metrics=metrics, plans=plans)
        except DevicePluginError as e:
            raise StartupError(str(e)) from None
        if mig is not None:
            teardown.undo(mig.stop)
        log.info(
            "plugin.server.started",
            resource=cfg.resource_name,
            socket=str(cfg.device_plugin_dir / cfg.socket_name),
            gpus=len(node.whole.devices) if node is not None else 0,
            shared=node.shared_names() if node is not None else [],
            mig={k: len(v) for k, v in mig.status().resources.items()} if mig is not None else None,
            fabric=found.topology.fabric if found.topology is not None else None,
        )
        if node is not None:
            threading.Thread(target=node.whole.prewarm, name="allocator-prewarm", daemon=True).start()
        monitor = start_health(cfg, found, node, mig)
        if monitor is not None:
            teardown.undo(monitor.stop)
        if cfg.metrics_port:
            def ready() -> bool:
                return (node is None or node.ready()) and (mig is None or mig.ready())

            try:
                server = MetricsServer(metrics.registry, ready, cfg.metrics_port).start()
            except OSError as e:
                raise StartupError(f"cannot serve metrics on port {cfg.metrics_port}: {e.strerror or e}") from None
            teardown.undo(server.stop)
            log.info("plugin.metrics.on", port=server.port)
        start_node_publication(cfg, node, pods, teardown, mig=mig, mig_state=mig_state_reader(found, node, mig, pods),
                               plans=plans)
        if on_ready is not None:
            on_ready()
        stop.wait()
        log.info("plugin.process.stopping")


def mig_state_reader(found: Discovered, node: Any, mig: Any, pods: Any) -> Callable[[], Any] | None:
    """The state's "mig" member as the MIG node serves it now (gpuplugin.mig_publication), for the publisher; None
    without MIG GPUs. NUMA nodes and NVLink islands are read once from NVML for every GPU (they do not change while
    the plugin runs): a MIG GPU's peers are the whole GPUs (by advertised id) and MIG GPUs of its island."""
    if mig is None:
        return None
    from gpuplugin.mig_publication import advertised_from, mig_block
    from gputopo.discovery.nvml import neighbourhood

    whole = node.whole.all_devices if node is not None else ()
    gpus = sorted({*((d.nvml_index, d.uuid) for d in whole), *found.mig_gpus})
    hood = neighbourhood(found.backend, gpus)
    whole_ids = {d.uuid: d.id for d in whole}
    log.info("plugin.mig.neighbourhood", islands={n: len(m) for n, m in hood.members.items()},
             mig_numa={u: hood.numa.get(u) for _, u in found.mig_gpus})

    def read() -> Any:
        status = mig.status()
        advertised = advertised_from(str(status.strategy), status.resources, status.reason(), hood, whole_ids)
        return mig_block(mig.layout, advertised, pods.in_use())

    return read


def start_node_publication(cfg: PluginConfig, node: Any, pods: Any, teardown: Teardown, *, mig: Any = None,
                           mig_state: Callable[[], Any] | None = None, plans: PlanFeed | None = None) -> None:
    """The node publisher: whole GPUs and their shared sets (`node`, None when every GPU is MIG) and the MIG
    resources (`mig`). A node of MIG GPUs only publishes its state without a topology. The plan watch (`plans`)
    tells it when a GPU pod ends."""
    options: dict[str, Any] = {"poll_interval_s": cfg.pod_resources_poll_interval}
    if node is not None and cfg.sharing_source is not None:
        options["sharing"] = lambda: node.sharing(pods.in_use())
        if cfg.sharing_labels:
            options["extra_labels"] = node.labels
    if mig_state is not None:
        options["mig"] = mig_state
        options["unhealthy"] = lambda: [*(node.unhealthy_ids() if node is not None else ()), *mig.unhealthy_ids()]
    if node is None and mig is None:
        return
    publisher = start_publication(cfg, node, **options)
    if publisher is not None and hasattr(publisher, "stop"):
        teardown.undo(publisher.stop)
    if publisher is not None:
        if plans is not None:
            # a GPU pod ended: publish its devices free as soon as the kubelet lets go of them (it may lag the API)
            plans.on_pod_ended(lambda: publisher.publisher.trigger(follow_s=POD_END_FOLLOW_S))
            teardown.undo(lambda: plans.on_pod_ended(None))  # before the publisher stops
        if mig is not None:
            mig.on_change = publisher.publisher.trigger  # an instance's health or a re-partition: publish now
            teardown.undo(lambda: setattr(mig, "on_change", None))  # before the publisher stops


class PlanFeed:
    """The plan watch of a running plugin and what takes its plans. Started, and its first list of the node's pods
    awaited, before any device plugin server registers (`attach` each target before it serves): the kubelet asks
    as soon as a plugin registers, and a pod bound while a crashed plugin was away is admitted right then. The
    publisher, started later, joins through `on_pod_ended`."""

    def __init__(self, watch: Any, close: Callable[[], None]) -> None:
        self.watch = watch
        self._close = close
        self._targets: list[Any] = []
        self._pod_ended: Callable[[], None] | None = None

    def attach(self, target: Any) -> None:
        target.set_plan_source(self.watch)
        self._targets.append(target)

    def on_pod_ended(self, hook: Callable[[], None] | None) -> None:
        self._pod_ended = hook

    def pod_ended(self) -> None:
        hook = self._pod_ended
        if hook is not None:
            hook()

    def stop(self) -> None:
        for target in self._targets:
            target.set_plan_source(None)
        self._close()


def open_plan_watch(cfg: PluginConfig, metrics: Any, stop: threading.Event, *,
                    shared: Callable[[], Collection[str]] | None = None) -> PlanFeed | None:
    """Plans from the scheduler extender: a watch on this node's pods feeding GetPreferredAllocation of every
    target attached (`set_plan_source`: the whole GPUs take the configured resource's plans, shared sets and MIG
    resources their own, named by `shared`), listed once (within PLAN_SYNC_WAIT_S, or until `stop`: a signal
    during the wait is not held up) before this returns. None (said once) when there is no cluster to watch; the
    plugin then answers with its own best subset, which on the same free set is the extender's choice anyway."""
    reason = no_cluster_reason(cfg)
    if reason is not None:
        log.info("plugin.plans.off", reason=reason)
        return None
    from gputopo.kube.client import KubeConfigError, make_api_client

    try:
        api = make_api_client()
    except KubeConfigError as e:
        log.warning("plugin.plans.off", reason=str(e))
        return None
    from gpuplugin.plan_watch import KUBELET_VIEW_TIMEOUT_S, PlanWatch
    from gpuplugin.podresources import PodResourcesClient

    # its own channel: the publisher's polls must not queue behind an admission's question, nor it behind them
    kubelet = PodResourcesClient(str(cfg.pod_resources_socket))
    feed: PlanFeed | None = None
    watch = PlanWatch(api, cfg.node_name or "", keys=cfg.keys, metrics=metrics, resource_name=cfg.resource_name,
                      on_device_pod_ended=lambda: feed.pod_ended() if feed is not None else None,
                      shared_resources=shared, kubelet_view=lambda: kubelet.pods(KUBELET_VIEW_TIMEOUT_S))

    def close() -> None:
        watch.stop()
        kubelet.close()
        api.close()

    feed = PlanFeed(watch, close)
    watch.start()
    deadline = time.monotonic() + PLAN_SYNC_WAIT_S
    while not (synced := watch.wait_synced(0.1)) and not stop.is_set() and time.monotonic() < deadline:
        pass
    if synced or stop.is_set():
        log.info("plugin.plans.on", node=cfg.node_name)
    else:
        log.warning("plugin.plans.unsynced", node=cfg.node_name, waited_s=PLAN_SYNC_WAIT_S,
                    hint="the node's pods could not be listed yet; plans are honoured once they are")
    return feed


def wait_without_gpus(cfg: PluginConfig, stop: threading.Event, why: str) -> None:
    """--no-fail-on-init-error: stay up advertising nothing (no registration with the kubelet), healthy on /healthz
    so the liveness probe does not restart-loop the pod, until a signal; a restart after the driver is fixed
    brings the GPUs."""
    from gpuplugin.metrics import MetricsServer, PluginMetrics
    from gputopo.metrics import process_registry

    log.warning("plugin.nvml.unavailable", error=why, action="waiting without GPUs (--no-fail-on-init-error)")
    server = None
    if cfg.metrics_port:
        server = MetricsServer(PluginMetrics(process_registry()).registry, lambda: True, cfg.metrics_port).start()
    try:
        stop.wait()
    finally:
        if server is not None:
            server.stop()



@click.command("run", epilog=SETTINGS.epilog)
@SETTINGS.command
def command(cfg: PluginConfig) -> None:
    """Serve the GPUs to the kubelet as a topology-aware device plugin."""
    configure_logging(cfg.log_level)
    output = ProcessOutput("plugin", cfg.log_level).start()
    try:
        serve_until_stopped(cfg)
    finally:
        output.stop()


def serve_until_stopped(cfg: PluginConfig) -> None:
    """`run`'s body once logging is set: serve until a signal; exit status 1 when the plugin cannot start."""
    stop = stop_on_signals("gpuplugin run")
    try:
        run_plugin(cfg, stop)
    except NvmlUnavailable as e:
        if cfg.fail_on_init_error:
            log.error("plugin.process.start_failed", error=str(e))
            click.echo(f"Error: {e}", err=True)
            sys.exit(1)
        wait_without_gpus(cfg, stop, str(e))
    except StartupError as e:
        log.error("plugin.process.start_failed", error=str(e))
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)
