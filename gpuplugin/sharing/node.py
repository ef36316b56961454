"""The node's GPUs as served: whole GPUs and shared sets, re-decided from the config file and the node label.

Decided on state, never on events: every pass re-reads the config directory and the node label, resolves the
layout, and compares it with the one served. A changed layout is applied only when no pod loses a device: every
device id the kubelet reports in use (PodResources) must still be advertised under the same resource afterwards;
otherwise the change waits (logged once) and the next pass tries again, so it lands as soon as the pods holding the
old devices end. A bad file or an unknown label value leaves the served layout as it is (the last good config),
logged once per distinct problem. When PodResources cannot be read, nothing but the first layout is applied.

Serving a layout: the whole-GPU manager serves the GPUs left whole (its runner stops when a shared set takes its
resource name or no GPU is left whole, and starts again when a later layout leaves some whole); each shared set
gets its own SharedResourceManager, PluginRunner (socket, registration) and, under MPS, MpsDaemon. A set whose
definition changed is replaced (stop, then start: the kubelet keeps allocated devices across a re-registration,
and the ids in use are still advertised); its MPS daemon quits then, while a plugin stop leaves it running for its
clients. GPU health is kept here across re-layouts.

With `mps_daemons="external"` the daemons are run by the MPS control daemon set (`gpuplugin mps-control`), which
outlives a plugin pod restart: the plugin writes the MPS sets it serves to the desired-state file instead
(gpuplugin.sharing.desired, rewritten whenever they change, a failed write retried with backoff), a replaced or
removed set gets a new generation there (the keeper quits its daemon), and each set's MpsDaemon only probes, so its
replicas stay unhealthy until the keeper's daemon answers. A plugin stop leaves the file as it is.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from gpuplugin.deviceplugin.resource import ResourceManager, Subscription
from gpuplugin.sharing.config import NO_SHARING, SharingConfig, SharingConfigError, choose_config, read_config
from gpuplugin.sharing.desired import (
    DesiredSet,
    DesiredStateError,
    current_desired,
    desired_path,
    encode,
    read_desired,
    write_desired,
)
from gpuplugin.sharing.layout import Layout, MigView, SharedSet, advertised_counts, describe, resolve, whole_layout
from gpuplugin.sharing.manager import SharedResourceManager
from gpuplugin.sharing.mps import DEFAULT_CONTROL, MpsDaemon, MpsGpu, MpsShare
from gputopo.core.codec import SharedGpu, SharedResource, Sharing
from gputopo.retry import Backoff
from gputopo.workers import Worker

log = structlog.get_logger(__name__)

Serve = Callable[[ResourceManager, str, str], Any]  # (manager, resource, socket name) -> a started PluginRunner
InUse = Callable[[], Mapping[str, Iterable[str]]]  # resource -> device ids the kubelet has allocated


@dataclass
class _Served:
    shared: SharedSet
    manager: SharedResourceManager
    runner: Any
    daemon: MpsDaemon | None = None


@dataclass
class ConfigSource:
    """Where configs come from: a directory of named files or one config file (`directory`, named for the common
    case; gpuplugin.sharing.config.choose_config tells them apart), the default's name, and the node label reader
    (None without a cluster or with one file; it raises when the API cannot be read, and the last label read is
    kept)."""

    directory: Path | None
    default: str | None = None
    read_label: Callable[[], str | None] | None = None


def socket_for(base: str, resource: str) -> str:
    """`<base stem>-<resource>.sock`: one socket per shared resource, beside the whole-GPU one."""
    stem = base.removesuffix(".sock")
    return f"{stem}-{re.sub(r'[^A-Za-z0-9_.-]', '_', resource)}.sock"


@dataclass
class Problems:
    """Each distinct problem logged once (a pass runs every few seconds)."""

    said: set[str] = field(default_factory=set)

    def first(self, message: str) -> bool:
        """True the first time `message` is seen since the last clear()."""
        if message in self.said:
            return False
        self.said.add(message)
        return True

    def clear(self) -> None:
        self.said.clear()


class SharingNode(Worker):
    def __init__(self, whole: ResourceManager, whole_resource: str, whole_socket: str, serve: Serve,
                 source: ConfigSource, *, in_use: InUse | None = None, mps_root: Path = Path("/run/nvidia/mps"),
                 mps_command: tuple[str, ...] = (DEFAULT_CONTROL,), mps_interval_s: float = 5.0,
                 poll_interval_s: float = 10.0, mig_view: Callable[[], MigView] | None = None,
                 mps_daemons: str = "in-plugin") -> None:
        super().__init__("sharing-node", join_timeout_s=30.0)
        self._mig_view = mig_view
        # the last config file read and validated (its flags.migStrategy is read by gpuplugin.sharing.mig_node)
        self.config: SharingConfig | None = None
        self.whole = whole
        self.topology = whole.topology
        self.whole_resource = whole_resource
        self.whole_socket = whole_socket
        self._serve = serve
        self.source = source
        self._in_use = in_use
        self.mps_root = mps_root
        self.mps_command = mps_command
        self.mps_interval_s = mps_interval_s
        if mps_daemons not in ("in-plugin", "external"):
            raise ValueError(f"mps_daemons must be in-plugin or external, not {mps_daemons!r}")
        self.mps_external = mps_daemons == "external"
        self._generations: dict[str, int] | None = None  # external: each MPS set's generation
        self._desired_written: str | None = None
        self._desired_backoff = Backoff(0.5, 30.0)
        self._desired_next = 0.0
        self._poll = poll_interval_s
        self._lock = threading.RLock()
        self.layout: Layout | None = None
        self._whole_runner: Any = None
        self._served: dict[str, _Served] = {}
        self._sick: set[str] = set()  # GPU uuids
        self._label: str | None = None
        self._problems = Problems()
        # why the config asked for now is refused (one line), None while it is served: the publisher turns it into
        # a Node condition and Event, so the platform team sees it without reading this log
        self.refused: str | None = None
        self._subs: set[Subscription] = set()
        self._plan_watch: Any = None
        self.applied = 0

    # -- what others read ---------------------------------------------------------------------------------------

    @property
    def all_devices(self) -> tuple[Any, ...]:
        return self.whole.all_devices

    def managers(self) -> list[ResourceManager]:
        with self._lock:
            return [self.whole, *(s.manager for s in self._served.values())]

    def shared_manager(self, resource: str) -> SharedResourceManager | None:
        with self._lock:
            served = self._served.get(resource)
            return served.manager if served else None

    def unhealthy_ids(self) -> list[str]:
        """Advertised ids of the GPUs that are unhealthy, whole or shared (the node state lists GPUs)."""
        by_uuid = {d.uuid: d.id for d in self.whole.all_devices}
        return sorted(by_uuid[u] for u in self._sick if u in by_uuid)

    def sharing(self, in_use: Mapping[str, Iterable[str]]) -> Sharing | None:
        """The state's "sharing" member: per shared resource, each GPU with its replicas and how many are held."""
        layout = self.layout
        if layout is None or not layout.shared:
            return None
        resources = []
        for s in layout.shared:
            held = set(in_use.get(s.name, ()))
            ids = {d.index: d.id for d in self.whole.all_devices}
            gpus = []
            for index, replicas in s.replicas:
                prefix = ids[index] + "::"
                used = sum(1 for x in held if x.startswith(prefix) and x[len(prefix):].isdigit()
                           and int(x[len(prefix):]) < replicas)
                gpus.append(SharedGpu(ids[index], replicas, used))
            resources.append(SharedResource(s.name, tuple(gpus)))
        return Sharing(layout.strategy or "time-slicing", layout.shared[0].fail_requests_greater_than_one,
                       tuple(resources))

    def subscribe(self) -> Subscription:
        """A subscription offered on every change of what is served or of its health (the publisher's trigger)."""
        sub = Subscription()
        with self._lock:
            self._subs.add(sub)
        sub.offer(())
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        sub.close()
        with self._lock:
            self._subs.discard(sub)

    def _changed(self) -> None:
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            sub.offer(())

    # -- health -------------------------------------------------------------------------------------------------

    def set_health(self, ids: Iterable[str], healthy: bool) -> list[str]:
        """From the health monitor (GPU UUIDs or advertised ids): every manager serving those GPUs follows."""
        to_uuid = {d.id: d.uuid for d in self.whole.all_devices} | {d.uuid: d.uuid for d in self.whole.all_devices}
        uuids = {to_uuid[x] for x in ids if x in to_uuid}
        with self._lock:
            self._sick = self._sick - uuids if healthy else self._sick | uuids
            managers = self.managers()
        changed: list[str] = []
        for m in managers:
            known = [u for u in uuids if u in {d.uuid for d in m.devices}]
            if known:
                changed += m.set_health(known, healthy)
        self._changed()
        return changed

    def _on_service(self, manager: SharedResourceManager) -> Callable[[bool], None]:
        def follow(ok: bool) -> None:
            manager.set_service_health(ok)
            self._changed()

        return follow

    # -- deciding -----------------------------------------------------------------------------------------------

    def desired(self) -> Layout | None:
        """The layout the config and label ask for now, or None when they cannot be served (said once)."""
        if self.source.read_label is not None:
            try:
                self._label = self.source.read_label()
            except Exception as e:  # the API is down: keep the last label read
                message = f"{type(e).__name__}: {e}"[:300]
                if self._problems.first(message):
                    log.warning("plugin.sharing.label_unreadable", error=message, label=self._label,
                                action="keeping the last label read")
        try:
            choice = choose_config(self.source.directory, self._label, self.source.default)
            config = NO_SHARING if choice.path is None else read_config(choice.path)
            self.config = config
            if choice.path is None:
                layout = whole_layout(self.topology)
            else:
                mig = self._mig_view() if self._mig_view is not None else None
                layout = resolve(config, self.topology, self.whole_resource, mig)
        except SharingConfigError as e:
            self._set_refused(" ".join(str(e).split()))  # one line: an Event's and a condition's message
            if self._problems.first(str(e)):
                log.warning("plugin.sharing.config_refused", error=str(e), field=e.field,
                            action="serving the last good config")
            return None
        self._set_refused(None)
        return layout

    def _set_refused(self, why: str | None) -> None:
        if why != self.refused:
            self.refused = why
            self._changed()  # the publisher reports it now, not at its next poll

    def _blocked(self, layout: Layout, in_use: Mapping[str, Iterable[str]]) -> list[str]:
        """Device ids in use that `layout` would stop advertising under their resource."""
        ids = {d.index: d.id for d in self.whole.all_devices}
        advertised: dict[str, set[str]] = {s.name: {f"{ids[i]}::{k}" for i, n in s.replicas for k in range(n)}
                                           for s in layout.shared}
        if layout.whole:
            advertised.setdefault(self.whole_resource, set()).update(ids[i] for i in layout.whole)
        dropped = sorted(x for resource, held in in_use.items() for x in held
                         if x not in advertised.get(resource, set()) and self._ours(x))
        # an MPS set replaced or removed restarts its daemon, which ends its clients' server: wait for them too
        wanted = {s.name: s for s in layout.shared}
        served = self.layout.shared if self.layout is not None else ()
        for old in served:
            if old.strategy == "mps" and wanted.get(old.name) != old:
                dropped += sorted(x for x in in_use.get(old.name, ()) if self._ours(x) and x not in dropped)
        return dropped

    def _ours(self, device_id: str) -> bool:
        gpu = device_id.split("::", 1)[0]
        return any(d.id == gpu for d in self.whole.all_devices)

    # -- the desired-state file (--mps-daemons external) -----------------------------------------------------------

    def _generation(self, name: str) -> int:
        if self._generations is None:  # a restarted plugin keeps the generations the keeper runs
            try:
                found = read_desired(self.mps_root) or {}
            except DesiredStateError as e:
                log.warning("plugin.mps_desired.unreadable", error=str(e), action="rewriting it")
                found = {}
            self._generations = {n: d.generation for n, d in found.items()}
        return self._generations.setdefault(name, 1)

    def _retired(self, name: str) -> None:
        """The set's daemon must quit: a later set of this name is a new generation, never this daemon."""
        if self.mps_external:
            self._generation(name)
            assert self._generations is not None
            self._generations[name] += 1

    def desired_sets(self) -> list[DesiredSet]:
        with self._lock:
            return [DesiredSet(s.daemon.share, self._generation(name)) for name, s in sorted(self._served.items())
                    if s.daemon is not None]

    def publish_desired(self) -> float | None:
        """Write the desired-state file when it differs from what was last written; the seconds until the next
        try after a failure, else None."""
        if not self.mps_external:
            return None
        now = time.monotonic()
        if now < self._desired_next:
            return self._desired_next - now
        sets = self.desired_sets()
        text = encode(sets)
        if text == self._desired_written and text == current_desired(self.mps_root):
            return None  # a file someone else changed or removed is written again
        try:
            write_desired(self.mps_root, sets)
        except OSError as e:
            delay = self._desired_backoff.failed()
            self._desired_next = now + delay
            log.warning("plugin.mps_desired.write_failed", path=str(desired_path(self.mps_root)),
                        error=e.strerror or str(e), retry_in_s=round(delay, 2))
            return delay
        self._desired_backoff.reset()
        self._desired_next = 0.0
        self._desired_written = text
        log.info("plugin.mps_desired.written", path=str(desired_path(self.mps_root)),
                 sets={d.share.resource: d.generation for d in sets})
        return None

    def step(self) -> float:
        retry = self.publish_desired()
        poll = self._poll if retry is None else min(self._poll, retry)
        layout = self.desired()
        if layout is None or layout == self.layout:
            return poll
        if self.layout is not None:
            if self._in_use is None:
                in_use: Mapping[str, Iterable[str]] | None = None
            else:
                try:
                    in_use = self._in_use()
                except Exception as e:
                    message = f"{type(e).__name__}: {e}"[:300]
                    if self._problems.first(message):
                        log.warning("plugin.sharing.podresources_failed", error=message,
                                    action="the config change waits until the kubelet says what is in use")
                    return poll
            blocked = self._blocked(layout, in_use) if in_use is not None else []
            if blocked:
                if self._problems.first(f"deferred {blocked}"):
                    log.warning("plugin.sharing.deferred", in_use=blocked[:8], held=len(blocked),
                                action="applied when the pods holding them end")
                return poll
        self.apply(layout)
        self._problems.clear()
        return poll

    def loop(self) -> None:
        self.run_passes(self.step, retry_s=self._poll, failed=lambda: log.exception("plugin.sharing.pass_failed"))

    # -- serving ------------------------------------------------------------------------------------------------

    def _mps_share(self, s: SharedSet) -> MpsShare:
        gpus = {g.index: g for g in self.topology.gpus}
        return MpsShare(s.name, self.mps_root,
                        tuple(MpsGpu(gpus[i].id, n, gpus[i].memory_mib) for i, n in s.replicas),
                        several_per_client=not (s.fail_requests_greater_than_one or s.distinct_gpus))

    def _start_set(self, s: SharedSet) -> _Served:
        share = self._mps_share(s) if s.strategy == "mps" else None
        w = self.whole
        manager = SharedResourceManager(
            self.topology, s, mps=share, id_strategy=w.id_strategy, list_strategy=w.list_strategy, keys=w.keys,
            dev_root=w.dev_root, minors={d.index: d.minor for d in w.all_devices},
            nvml_indices={d.index: d.nvml_index for d in w.all_devices}, metrics=w.metrics,
            plans=self._plan_watch.for_resource(s.name) if self._plan_watch is not None else None)
        sick = [u for u in self._sick if manager.knows(u)]
        if sick:
            manager.set_health(sick, False)
        daemon = None
        if share is not None:
            daemon = MpsDaemon(share, self._on_service(manager), command=self.mps_command,
                               interval_s=self.mps_interval_s, manage=not self.mps_external)
            daemon.start()
        runner = self._serve(manager, s.name, socket_for(self.whole_socket, s.name))
        return _Served(s, manager, runner, daemon)

    @staticmethod
    def _stop_set(served: _Served, *, retire: bool) -> None:
        """`retire`: the config dropped or replaced the set, so its MPS daemon quits; a plugin stop leaves it to the
        pods holding its replicas (the next plugin adopts it)."""
        served.runner.stop()
        if served.daemon is not None:
            served.daemon.stop(retire=retire)
        served.manager.close()

    def apply(self, layout: Layout) -> None:
        """Serve `layout` (the caller decided it is safe)."""
        with self._lock:
            wanted = {s.name: s for s in layout.shared}
            for name in list(self._served):
                if wanted.get(name) != self._served[name].shared:
                    gone = self._served.pop(name)
                    self._stop_set(gone, retire=True)
                    if gone.daemon is not None:
                        self._retired(name)
            self.whole.set_gpus(layout.whole)
            # Whole GPUs are registered only while there are some: a resource of 0 devices (every GPU shared and
            # renamed) would show as nvidia.com/gpu: 0 in the node's capacity, which NVIDIA's plugin never shows.
            serve_whole = bool(layout.whole) and self.whole_resource not in wanted
            if not serve_whole and self._whole_runner is not None:
                self._whole_runner.stop()
                self._whole_runner = None
            for name, s in wanted.items():
                if name not in self._served:
                    self._served[name] = self._start_set(s)
            if serve_whole and self._whole_runner is None:
                self._whole_runner = self._serve(self.whole, self.whole_resource, self.whole_socket)
            self.layout = layout
            self.applied += 1
        self.publish_desired()
        log.info("plugin.sharing.applied", counts=advertised_counts(layout, self.whole_resource),
                 shared=list(describe(layout)), label=self._label)
        self._changed()

    def start(self) -> SharingNode:
        """Serve the layout asked for now (the whole node when the config cannot be read), then keep watching."""
        self.apply(self.desired() or whole_layout(self.topology))
        return super().start()

    def stop(self, timeout: float | None = None) -> None:
        super().stop(timeout)
        with self._lock:
            for name in list(self._served):
                self._stop_set(self._served.pop(name), retire=False)
            if self._whole_runner is not None:
                self._whole_runner.stop()
                self._whole_runner = None
            subs, self._subs = list(self._subs), set()
        for sub in subs:
            sub.close()

    def set_plan_source(self, watch: Any) -> None:
        """The PlanWatch (or None): whole GPUs take its plans, each shared set its own resource's."""
        with self._lock:
            self._plan_watch = watch
            self.whole.set_plan_source(watch)
            for s in self._served.values():
                s.manager.set_plan_source(watch.for_resource(s.shared.name) if watch is not None else None)

    def shared_names(self) -> list[str]:
        layout = self.layout
        return [s.name for s in layout.shared] if layout else []

    def labels(self) -> dict[str, str | None]:
        from gpuplugin.sharing.labels import gfd_labels

        return gfd_labels(self.layout or whole_layout(self.topology), self.topology, self.whole_resource)

    @property
    def whole_runner(self) -> Any:
        return self._whole_runner

    def runner(self, resource: str) -> Any:
        with self._lock:
            if resource == self.whole_resource and self._whole_runner is not None:
                return self._whole_runner
            served = self._served.get(resource)
            return served.runner if served else None

    def ready(self) -> bool:
        with self._lock:
            runners = [r for r in (self._whole_runner, *(s.runner for s in self._served.values())) if r is not None]
        return bool(runners) and all(r.ready() for r in runners)
