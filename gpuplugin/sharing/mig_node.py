"""The node's MIG devices as served: one kubelet registration per MIG resource, re-decided from NVML on a timer.

Decided on state, never on events: every pass reads the MIG layout through NVML again (gputopo.discovery.nvml_mig),
takes the strategy (the `mig-strategy` setting, else the sharing config's `flags.migStrategy`, else none), plans
what it advertises (gpuplugin.sharing.mig_strategy) and compares that with what is served. A re-partition (instances
created or destroyed), or a strategy change through the node's config label, is re-advertised without a restart:
a resource that appears gets its own MigResourceManager and PluginRunner (socket `<stem>-<resource>.sock`,
registration, ListAndWatch), one that changes gets the new complete device list on its streams, one that goes away
is stopped.

Never taking away an instance a pod holds: the kubelet's PodResources says which device ids are allocated; a held
id the new plan drops stays advertised under its resource, Unhealthy (so the kubelet hands it to nobody else), until
a pass finds it released, and only then goes. When PodResources cannot be read, nothing is dropped that pass.

Health: per instance from the health monitor (`set_instance_health`, fed by HealthMonitor.on_instance_change);
`on_instances` is told the instances to watch after every change.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from gpuplugin.deviceplugin.mig import MigResourceManager
from gpuplugin.sharing.config import SharingConfig, SharingConfigError, choose_config, read_config
from gpuplugin.sharing.layout import MigShare, MigSharing, MigView, check_mps_on_mig, share_mig
from gpuplugin.sharing.mig_strategy import MigInstance, MigPlan, MigStrategy, plan_mig
from gpuplugin.sharing.node import ConfigSource, InUse, Problems, Serve, socket_for
from gputopo.discovery.nvml import neighbourhood
from gputopo.discovery.nvml_backend import NvmlBackend
from gputopo.discovery.nvml_mig import MigGpu, discover_mig
from gputopo.workers import Worker

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class MigStatus:
    """What the node's MIG serving is now, for the publisher to put on the Node (`reason()` is the one line)."""

    strategy: MigStrategy
    strategy_from: str  # "setting" | "sharing config flags.migStrategy" | "default"
    resources: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # advertised MIG UUIDs per resource
    left_out: Mapping[str, str] = field(default_factory=dict)  # GPU or MIG UUID -> why it is not advertised
    refused: str | None = None  # the strategy refused as a whole (single on a non-uniform node)
    draining: tuple[str, ...] = ()  # MIG UUIDs the layout dropped, advertised until their pods release them
    replicas: Mapping[str, Mapping[str, int]] = field(default_factory=dict)  # time-sliced resource -> UUID -> n

    def reason(self) -> str | None:
        """Why MIG devices of this node are not advertised, in one line; None when every one is."""
        if self.refused is not None:
            return f"mig strategy {self.strategy} refused: {self.refused}"
        if not self.left_out:
            return None
        shown = "; ".join(f"{k}: {v}" for k, v in sorted(self.left_out.items())[:4])
        more = f" (and {len(self.left_out) - 4} more)" if len(self.left_out) > 4 else ""
        return f"mig strategy {self.strategy}: {len(self.left_out)} left out: {shown}{more}"


@dataclass
class _Served:
    manager: MigResourceManager
    runner: Any


class MigNode(Worker):
    def __init__(self, backend: NvmlBackend, gpus: Sequence[tuple[int, str]], *, whole_gpus: int,
                 whole_resource: str, whole_socket: str, serve: Serve, strategy: MigStrategy | None,
                 read_config: Callable[[], SharingConfig | None] = lambda: None, in_use: InUse | None = None,
                 on_instances: Callable[[Sequence[MigInstance]], None] | None = None,
                 manager_options: Mapping[str, Any] | None = None, poll_interval_s: float = 10.0) -> None:
        # `on_instances` may also be set after construction (the health monitor is made once instances are known)
        super().__init__("mig-node", join_timeout_s=30.0)
        self.backend = backend
        self.gpus = tuple(gpus)
        self.whole_gpus = whole_gpus
        self.whole_resource = whole_resource
        self.whole_socket = whole_socket
        self._serve = serve
        self.setting = strategy
        self._read_config = read_config
        self._in_use = in_use
        self.on_instances = on_instances
        self._options = dict(manager_options or {})
        self._poll = poll_interval_s
        self._lock = threading.RLock()
        self._served: dict[str, _Served] = {}
        self._draining: dict[str, set[str]] = {}  # resource -> MIG UUIDs kept only because a pod holds them
        self._sick: set[str] = set()
        self._problems = Problems()
        self._status = MigStatus(MigStrategy.NONE, "default")
        self.layout: tuple[MigGpu, ...] = ()
        self.passes = 0
        self._numa = self._parent_numa()
        self._plan_watch: Any = None  # gpuplugin.plan_watch.PlanWatch: each resource takes its own plans
        # told after a health change or a re-advertisement (the publisher publishes at once, not at its next poll)
        self.on_change: Callable[[], None] | None = None

    def _parent_numa(self) -> dict[int, int | None]:
        """Each MIG GPU's NUMA node by NVML index, which its MIG devices advertise (the parent's, as NVIDIA's plugin
        does) so the Topology Manager can align them. Read by the rule whole GPUs follow (neighbourhood: NVML, else
        the kernel's sysfs numa_node), because NVML answers NotSupported on the H200 and only sysfs knows there."""
        try:
            hood = neighbourhood(self.backend, self.gpus)
        except Exception as e:  # NUMA is a hint: serving goes on without it
            log.warning("plugin.mig.numa_unknown", error=f"{type(e).__name__}: {e}"[:300],
                        action="MIG devices advertised without a NUMA node")
            return {}
        return {i: hood.numa.get(uuid) for i, uuid in self.gpus}

    # -- what others read ---------------------------------------------------------------------------------------

    def status(self) -> MigStatus:
        """The publisher's view: strategy, advertised MIG UUIDs per resource, what is left out and why."""
        with self._lock:
            return self._status

    def served(self) -> dict[str, tuple[MigInstance, ...]]:
        """Per MIG resource, the instances advertised now (profile, placement and parent GPU in each)."""
        with self._lock:
            return {name: s.manager.instances() for name, s in sorted(self._served.items())}

    def view(self) -> MigView:
        """For the sharing layout's MIG + MPS check."""
        with self._lock:
            resources = {name: frozenset(i.uuid for i in s.manager.instances()) for name, s in self._served.items()}
        return MigView(resources, frozenset(uuid for _, uuid in self.gpus))

    def resource_names(self) -> list[str]:
        with self._lock:
            return sorted(self._served)

    def manager(self, resource: str) -> MigResourceManager | None:
        with self._lock:
            s = self._served.get(resource)
            return s.manager if s else None

    def runner(self, resource: str) -> Any:
        with self._lock:
            s = self._served.get(resource)
            return s.runner if s else None

    def unhealthy_ids(self) -> list[str]:
        """MIG UUIDs served now that the health monitor marked unhealthy (for the published state; instances kept
        only for the pods holding them are held, and published so, not unhealthy)."""
        with self._lock:
            served = {i.uuid for s in self._served.values() for i in s.manager.instances()}
            return sorted(self._sick & served)

    def ready(self) -> bool:
        with self._lock:
            return all(s.runner.ready() for s in self._served.values())

    def set_plan_source(self, watch: Any) -> None:
        """The PlanWatch (or None): each MIG resource served, now and after a re-partition, takes the plans of its
        own resource (`watch.for_resource`), whose ids are MIG UUIDs."""
        with self._lock:
            self._plan_watch = watch
            for name, s in self._served.items():
                s.manager.set_plan_source(watch.for_resource(name) if watch is not None else None)

    # -- health -------------------------------------------------------------------------------------------------

    def set_instance_health(self, uuids: Iterable[str], healthy: bool) -> None:
        """From HealthMonitor.on_instance_change (MIG UUIDs)."""
        ids = set(uuids)
        with self._lock:
            self._sick = self._sick - ids if healthy else self._sick | ids
            self._reconcile_health()
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            try:
                self.on_change()
            except Exception:  # whoever listens must not break health or serving
                log.exception("plugin.mig.notify_failed")

    def _reconcile_health(self) -> None:
        for name, s in self._served.items():
            bad = self._sick | self._draining.get(name, set())
            sick = [d.id for d in s.manager.devices if d.uuid in bad]
            well = [d.id for d in s.manager.devices if d.uuid not in bad]
            if sick:
                s.manager.set_health(sick, False)
            if well:
                s.manager.set_health(well, True)

    # -- deciding -----------------------------------------------------------------------------------------------

    def _strategy(self, config: SharingConfig | None) -> tuple[MigStrategy, str]:
        if self.setting is not None:
            return self.setting, "setting"
        if config is not None and config.mig_strategy is not None:
            return config.mig_strategy, "sharing config flags.migStrategy"
        return MigStrategy.NONE, "default"

    def _first(self, event: str, message: str) -> bool:
        """True the first time this problem is seen (a pass runs every few seconds: each is logged once)."""
        return self._problems.first(f"{event}:{message}")

    def step(self) -> float:
        try:
            layout = discover_mig(self.backend, self.gpus, quiet=self.passes > 0)
        except Exception as e:  # NVML gone for a moment: keep serving what is served
            error = f"{type(e).__name__}: {e}"[:300]
            if self._first("discovery_failed", error):
                log.warning("plugin.mig.discovery_failed", error=error, action="keeping the layout")
            return self._poll
        config = self._read_config()
        strategy, source = self._strategy(config)
        plan = plan_mig(strategy, layout, self.whole_gpus, self.whole_resource)
        if plan.refused is not None and self._first("strategy_refused", plan.refused):
            log.warning("plugin.mig.strategy_refused", error=plan.refused, strategy=str(strategy),
                        action="no MIG device advertised; whole GPUs served")
        if config is not None:
            try:
                check_mps_on_mig(config, MigView({k: frozenset(v) for k, v in plan.ids().items()},
                                                 frozenset(u for _, u in self.gpus)), self.whole_resource)
            except SharingConfigError as e:
                if self._first("mps_refused", str(e)):
                    log.warning("plugin.mig.mps_refused", error=str(e), field=e.field,
                                action="the MPS config is not applied")
        sharing = MigSharing(dict(plan.resources))
        try:
            sharing = share_mig(config, plan.resources, self.whole_resource)
        except SharingConfigError as e:
            if self._first("sharing_refused", str(e)):
                log.warning("plugin.mig.sharing_refused", error=str(e), field=e.field,
                            action="MIG devices served unshared")
        held: Mapping[str, Iterable[str]] | None
        if self._in_use is None or not self._drops(sharing):  # nothing would go: no need to ask the kubelet
            held = {}
        else:
            try:
                held = self._in_use()
            except Exception as e:
                error = f"{type(e).__name__}: {e}"[:300]
                if self._first("podresources_failed", error):
                    log.warning("plugin.mig.podresources_failed", error=error,
                                action="nothing is taken away until the kubelet says what is in use")
                held = None
        self.apply(plan, held, source, sharing)
        self.layout = layout
        self.passes += 1
        return self._poll

    def _drops(self, sharing: MigSharing) -> bool:
        """Whether serving `sharing` would stop advertising a device served now (only then is PodResources asked:
        the kubelet rate-limits it)."""
        with self._lock:
            for name, s in self._served.items():
                wanted = {i.uuid for i in sharing.resources.get(name, ())}
                if any(i.uuid not in wanted for i in s.manager.instances()) or (
                        s.manager.share != sharing.shares.get(name)):
                    return True
        return False

    def loop(self) -> None:
        self.run_passes(self.step, retry_s=self._poll, failed=lambda: log.exception("plugin.mig.pass_failed"),
                        first_delay_s=self._poll)

    # -- serving ------------------------------------------------------------------------------------------------

    def apply(self, plan: MigPlan, held: Mapping[str, Iterable[str]] | None, source: str,
              sharing: MigSharing | None = None) -> None:
        """Serve `plan` (its resources time-sliced as `sharing` says), keeping every served instance a pod holds
        (`held`: resource -> device ids; None: unknown, keep everything served)."""
        sharing = sharing if sharing is not None else MigSharing(dict(plan.resources))
        with self._lock:
            wanted: dict[str, dict[str, MigInstance]] = {
                name: {i.uuid: i for i in insts} for name, insts in sharing.resources.items()}
            shares: dict[str, MigShare | None] = {name: sharing.shares.get(name) for name in wanted}
            draining: dict[str, set[str]] = {}
            for name, s in self._served.items():
                keep = None if held is None else {x.split("::", 1)[0] for x in held.get(name, ())}
                for inst in s.manager.instances():
                    if inst.uuid in wanted.get(name, {}):
                        continue
                    if keep is None or inst.uuid in keep:
                        wanted.setdefault(name, {})[inst.uuid] = inst
                        draining.setdefault(name, set()).add(inst.uuid)
                        old = s.manager.share
                        if old is not None and inst.uuid in old.replicas:  # keep its replicas as they were
                            new = shares.get(name) or MigShare({}, old.fail_requests_greater_than_one, old.distinct)
                            shares[name] = MigShare({**new.replicas, inst.uuid: old.replicas[inst.uuid]},
                                                    new.fail_requests_greater_than_one, new.distinct)
            before = {name: ({i.uuid for i in s.manager.instances()}, s.manager.share)
                      for name, s in self._served.items()}
            for name in [n for n in self._served if n not in wanted]:
                s = self._served.pop(name)
                s.runner.stop()
                s.manager.close()
                log.info("plugin.mig.resource_stopped", resource=name)
            for name, insts in sorted(wanted.items()):
                share = shares.get(name)
                if name in self._served:
                    if before.get(name) != (set(insts), share):
                        self._served[name].manager.set_instances(insts.values(), share)
                    continue
                manager = MigResourceManager(name, insts.values(), share=share, numa=self._numa, **self._options)
                if self._plan_watch is not None:
                    manager.set_plan_source(self._plan_watch.for_resource(name))
                runner = self._serve(manager, name, socket_for(self.whole_socket, name))
                self._served[name] = _Served(manager, runner)
                log.info("plugin.mig.resource_started", resource=name, devices=len(insts))
            self._draining = draining
            self._reconcile_health()
            after = {name: ({i.uuid for i in s.manager.instances()}, s.manager.share)
                     for name, s in self._served.items()}
            self._status = MigStatus(
                plan.strategy, source, {n: tuple(sorted(ids)) for n, (ids, _) in sorted(after.items())},
                dict(plan.left_out), plan.refused, tuple(sorted(u for ids in draining.values() for u in ids)),
                {n: dict(share.replicas) for n, (_, share) in sorted(after.items()) if share is not None})
            changed = after != before
            instances = [i for s in self._served.values() for i in s.manager.instances()]
        if changed:
            log.info("plugin.mig.applied", strategy=str(plan.strategy), strategy_from=source,
                     counts={n: len(s.manager.devices) for n, s in sorted(self._served.items())},
                     draining=sorted(u for ids in draining.values() for u in ids)[:8])
            if self.on_instances is not None:
                self.on_instances(instances)
            self._changed()

    def start(self) -> MigNode:
        """Serve the layout NVML gives now, then keep re-reading it."""
        self.step()
        return super().start()

    def stop(self, timeout: float | None = None) -> None:
        super().stop(timeout)
        with self._lock:
            for name in list(self._served):
                s = self._served.pop(name)
                s.runner.stop()
                s.manager.close()


def config_reader(source: ConfigSource) -> Callable[[], SharingConfig | None]:
    """The config file the node label (else the default) names, read at each call, for a node with no whole GPU
    (no SharingNode reads it there); a bad file or an unreadable label keeps the last good one."""
    state: dict[str, Any] = {"label": None, "config": None}
    problems = Problems()

    def read() -> SharingConfig | None:
        if source.read_label is not None:
            try:
                state["label"] = source.read_label()
            except Exception as e:
                if problems.first(f"label:{type(e).__name__}: {e}"[:300]):
                    log.warning("plugin.sharing.label_unreadable", error=f"{type(e).__name__}: {e}"[:300],
                                label=state["label"], action="keeping the last label read")
        try:
            choice = choose_config(source.directory, state["label"], source.default)
            state["config"] = None if choice.path is None else read_config(choice.path)
        except SharingConfigError as e:
            if problems.first(str(e)):
                log.warning("plugin.sharing.config_refused", error=str(e), field=e.field,
                            action="serving the last good config")
        return state["config"]

    return read
