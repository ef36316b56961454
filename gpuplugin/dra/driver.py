"""The DRA driver's node-side logic: prepare and unprepare claims, GPU health, and what to publish. No gRPC, no
Kubernetes client: the claim getter and the change callback are handed in.

- Prepare is idempotent (a prepared claim answers from the state file) and all-or-nothing per claim: nothing is
  written unless every check passed, and the CDI spec is removed again if the state cannot be saved.
- A claim whose devices would share a GPU with another prepared claim is refused: the allocator should never do
  that, and if a republish ever let it, this is the last line that keeps a GPU from being handed out twice. The
  same holds for a MIG instance; a shared GPU is refused instead when the claims prepared on it would consume more
  than its capacity (gpuplugin.dra.partitions).
- A shared GPU's claim gets what the device plugin's Allocate gives a container holding that many replicas of it:
  under MPS the pipe directory, the per-client thread and memory limits and the mounts (MpsShare.client), through
  its CDI device; time-slicing adds nothing to the GPU's device node.
- Unprepare of an unknown claim succeeds (the kubelet may repeat it, after our restart or the claim's deletion).
- A prepared claim whose ResourceClaim is gone (gpuplugin.dra.liveness) is released as an unprepare would release
  it (state, CDI spec, republish): the kubelet that lost its checkpoint never unprepares it, and its GPUs would
  stay held for good. The reconciler (gpuplugin.dra.reconcile) finds such claims at start and on a timer; a
  prepare that clashes with a holder looks that holder up first, so a claim the scheduler was right to give the
  GPUs to is not refused until the next pass.
- A GPU turning unhealthy taints the devices holding it (republished) and shows in the health stream; claims
  already prepared keep their devices (the kubelet decides about running pods); new prepares of it are refused.
Calls are serialised, as the Go helper does by default.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import structlog

from gpuplugin.dra.catalog import Catalog, Device
from gpuplugin.dra.cdi import CdiWriter, DeviceEdits
from gpuplugin.dra.claims import Result, our_config, our_results
from gpuplugin.dra.errors import ClaimError, DraError, HeldElsewhere
from gpuplugin.dra.liveness import ClaimGetter, Verdict, judge
from gpuplugin.dra.metrics import DraMetrics
from gpuplugin.dra.state import PreparedClaim, PreparedDevice, StateFile
from gpuplugin.sharing.mps import MpsShare

log = structlog.get_logger(__name__)

MAX_HOLDER_LOOKUPS = 16  # claims a clashing prepare looks up (each one GET, under the lock): bounds its time


@dataclass(frozen=True)
class ClaimKey:
    namespace: str
    uid: str
    name: str


class Driver:
    def __init__(
        self,
        catalog: Catalog,
        *,
        driver_name: str,
        pool: str,
        state: StateFile,
        cdi: CdiWriter,
        get_claim: ClaimGetter,
        minors: Mapping[int, int] | None = None,
        nvidia_cdi: bool = True,
        metrics: DraMetrics | None = None,
        on_change: Callable[[], None] = lambda: None,
        mps: Mapping[str, MpsShare] | None = None,
    ) -> None:
        self.catalog = catalog
        self.mps = dict(mps or {})  # GPU UUID -> the MPS share it is served through
        self.driver_name = driver_name
        self.pool = pool
        self.state = state
        self.cdi = cdi
        self.get_claim = get_claim
        self.minors = dict(minors or {})
        self.nvidia_cdi = nvidia_cdi
        self.metrics = metrics if metrics is not None else DraMetrics()
        self.on_change = on_change
        self._lock = threading.RLock()
        self._health_cond = threading.Condition(self._lock)
        self._health_serial = 0
        self._unhealthy: dict[int, str] = {}
        self._sick_instances: dict[str, str] = {}  # MIG device name -> why (its own Xids)
        self._claims = state.load()
        self._check_loaded()
        stale = cdi.remove_all_but(self._claims)
        if stale:
            log.warning("dra.cdi.removed_stale", claims=stale)

    def _uuids(self, device: Device) -> tuple[str, ...]:
        ids = self.catalog.topology.ids
        return tuple(ids[g] for g in device.gpus) if device.kind == "gpus" else (device.uuid,)

    def _check_loaded(self) -> None:
        for claim in self._claims.values():
            for d in claim.devices:
                members = self.catalog.devices.get(d.device)
                now = self._uuids(members) if members else None
                if now != d.gpus:
                    log.error("dra.state.mismatch", claim=claim.uid, device=d.device, recorded=d.gpus,
                              now=now, why="the topology changed under a prepared claim")

    def use_catalog(self, catalog: Catalog) -> bool:
        """Serve `catalog` from now on (the publisher's fallback to whole GPUs); False, and nothing changes, when a
        prepared claim holds a device that `catalog` lacks or has otherwise."""
        with self._lock:
            lost = sorted(d.device for c in self._claims.values() for d in c.devices
                          if d.device not in catalog.devices or catalog.devices[d.device] != self.catalog.devices.get(
                              d.device))
            if lost:
                log.error("dra.catalog.switch_refused", held=lost[:8], why="prepared claims hold these devices")
                return False
            self.catalog = catalog
            log.info("dra.catalog.switched", summary=catalog.summary())
            return True

    # ---- state for the publisher ----

    def used_gpus(self) -> set[int]:
        with self._lock:
            return self.catalog.gpus_of(d.device for c in self._claims.values() for d in c.devices
                                        if d.device in self.catalog.devices)

    def unhealthy_gpus(self) -> set[int]:
        with self._lock:
            return set(self._unhealthy)

    def sick_devices(self) -> set[str]:
        """MIG devices unhealthy by their own instance's Xids (their GPU is not in the topology)."""
        with self._lock:
            return set(self._sick_instances)

    def held_devices(self) -> set[str]:
        with self._lock:
            return {d.device for c in self._claims.values() for d in c.devices}

    def prepared(self) -> dict[str, PreparedClaim]:
        with self._lock:
            return dict(self._claims)

    # ---- prepare / unprepare ----

    def prepare(self, claims: Sequence[ClaimKey]) -> dict[str, tuple[PreparedDevice, ...] | str]:
        """Per claim UID: its prepared devices, or an error message. Never raises for one bad claim."""
        out: dict[str, tuple[PreparedDevice, ...] | str] = {}
        changed = False
        with self._lock:
            for key in claims:
                try:
                    existing = self._claims.get(key.uid)
                    if existing is not None:
                        out[key.uid] = existing.devices
                        self.metrics.prepares.labels(result="repeat").inc()
                        continue
                    try:
                        out[key.uid] = self._prepare_one(key)
                    except HeldElsewhere as e:
                        if not self._release_gone(e.holders):
                            raise
                        changed = True
                        out[key.uid] = self._prepare_one(key)  # once: what still clashes is refused
                    changed = True
                    self.metrics.prepares.labels(result="ok").inc()
                except DraError as e:
                    out[key.uid] = str(e)
                    self.metrics.prepares.labels(result="error").inc()
                    log.warning("dra.prepare.failed", claim=f"{key.namespace}/{key.name}", uid=key.uid,
                                error=str(e))
                except Exception as e:  # the API failed (typed kube errors and anything else): say so, keep serving
                    out[key.uid] = f"cannot read claim {key.namespace}/{key.name}: {e}"
                    self.metrics.prepares.labels(result="error").inc()
                    log.warning("dra.prepare.failed", claim=f"{key.namespace}/{key.name}", uid=key.uid,
                                error=str(e))
        if changed:
            self.on_change()
        return out

    def _prepare_one(self, key: ClaimKey) -> tuple[PreparedDevice, ...]:
        claim = self.get_claim(key.namespace, key.name)
        devices = self.catalog.devices
        results = our_results(claim, key.uid, self.driver_name, self.pool, devices)
        env = our_config(claim, self.driver_name)
        where = f"{key.namespace}/{key.name}"
        whole = [r for r in results if devices[r.device].kind == "gpus"]
        gpus = [g for r in whole for g in devices[r.device].gpus]
        if len(gpus) != len(set(gpus)):
            raise ClaimError(f"claim {where} is allocated devices that share GPUs")
        held = {g: c for c in self._claims.values() for d in c.devices if d.device in devices
                and devices[d.device].kind == "gpus" for g in devices[d.device].gpus}
        clash = sorted({held[g].namespace + "/" + held[g].name for g in gpus if g in held})
        if clash:
            raise HeldElsewhere(f"claim {where} is allocated GPUs {sorted(set(gpus) & set(held))} "
                                f"that claim(s) {', '.join(clash)} hold: refusing to hand a GPU out twice",
                                tuple(dict.fromkeys(held[g].uid for g in gpus if g in held)))
        self._check_mig(where, results)
        self._check_capacity(where, results)
        ill = sorted({r.device for r in results if r.device in self._sick_instances})
        if ill:
            raise ClaimError(f"claim {where} is allocated unhealthy MIG instances: "
                             + "; ".join(f"{n}: {self._sick_instances[n]}" for n in ill))
        sick = sorted({g for r in results for g in devices[r.device].gpus if g in self._unhealthy})
        if sick:
            why = "; ".join(f"GPU {g} ({self.catalog.topology.gpus[g].id}): {self._unhealthy[g]}" for g in sick)
            raise ClaimError(f"claim {where} is allocated unhealthy GPUs: {why}")
        by_entry: dict[tuple[str, str | None], list[Result]] = {}
        for r in results:
            by_entry.setdefault((r.device, r.share_id), []).append(r)
        edits = {name: self._edits(devices[name], [r for r in results if r.device == name])
                 for name in dict.fromkeys(r.device for r in results)}
        prepared = []
        for (name, share), rs in by_entry.items():
            device = devices[name]
            uuids = self._uuids(device)
            cdi_ids = [self.cdi.device_id(key.uid, name)]
            if self.nvidia_cdi:
                cdi_ids += [f"nvidia.com/gpu={u}" for u in uuids]
            requests = tuple(dict.fromkeys(r.request for r in rs))
            replicas = sum(r.consumed.replicas for r in rs if r.consumed)
            memory = sum(r.consumed.memory_mib for r in rs if r.consumed)
            prepared.append(PreparedDevice(requests, self.pool, name, uuids, tuple(cdi_ids), share, replicas, memory))
        self.cdi.write(key.uid, edits, env)
        claims = dict(self._claims)
        claims[key.uid] = PreparedClaim(key.uid, key.namespace, key.name, tuple(prepared))
        try:
            self.state.save(claims)
        except DraError:
            self.cdi.remove(key.uid)
            raise
        self._claims = claims
        log.info("dra.claim.prepared", claim=where, uid=key.uid, devices=list(edits))
        return tuple(prepared)

    def _check_mig(self, where: str, results: Sequence[Result]) -> None:
        """A MIG instance goes to one claim, once."""
        names = [r.device for r in results if self.catalog.devices[r.device].kind == "mig"]
        if len(names) != len(set(names)):
            raise ClaimError(f"claim {where} is allocated one MIG instance twice")
        holders = {d.device: c for c in self._claims.values() for d in c.devices}
        taken = sorted(n for n in names if n in holders)
        if taken:
            raise HeldElsewhere(f"claim {where} is allocated MIG instance(s) {taken} that claim(s) "
                                f"{sorted({holders[n].namespace + '/' + holders[n].name for n in taken})} hold: "
                                "refusing to hand an instance out twice",
                                tuple(dict.fromkeys(holders[n].uid for n in taken)))

    def _check_capacity(self, where: str, results: Sequence[Result]) -> None:
        """The claims prepared on a shared GPU never consume more than its capacity: the scheduler accounts it,
        and this keeps a stale or forged allocation from overcommitting the GPU."""
        devices = self.catalog.devices
        for name in dict.fromkeys(r.device for r in results if devices[r.device].multi):
            device = devices[name]
            mine = [r.consumed for r in results if r.device == name and r.consumed]
            owners = [c for c in self._claims.values() if any(d.device == name for d in c.devices)]
            others = [d for c in owners for d in c.devices if d.device == name]
            replicas = sum(c.replicas for c in mine) + sum(d.replicas for d in others)
            memory = sum(c.memory_mib for c in mine) + sum(d.memory_mib for d in others)
            total_memory = device.replicas * (device.share_mib or 0)
            if replicas > device.replicas or (device.share_mib and memory > total_memory):
                used_r = sum(d.replicas for d in others)
                used_m = sum(d.memory_mib for d in others)
                raise HeldElsewhere(
                    f"claim {where} asks {sum(c.replicas for c in mine)} replicas and "
                    f"{sum(c.memory_mib for c in mine)}Mi of shared GPU {name}, beyond what is left: {len(others)} "
                    f"prepared allocation(s) hold {used_r} of {device.replicas} replicas and {used_m} of "
                    f"{total_memory}Mi", tuple(c.uid for c in owners))

    def _edits(self, device: Device, results: Sequence[Result]) -> DeviceEdits:
        """The CDI edits of one device of a claim (all its results on that device together)."""
        if device.kind == "mig":
            if not device.device_nodes and not self.nvidia_cdi:
                raise ClaimError(f"MIG instance {device.name} ({device.uuid}): its device nodes are unknown "
                                 "(/proc/driver/nvidia-caps/mig-minors unreadable) and NVIDIA's CDI names are off")
            return DeviceEdits(device.device_nodes)
        nodes = tuple(f"/dev/nvidia{self.minors.get(g, g)}" for g in device.gpus)
        share = self.mps.get(device.uuid) if device.kind == "shared" else None
        if share is None:
            return DeviceEdits(nodes)
        held = sum(r.consumed.shares(device.share_mib) for r in results if r.consumed) or 1
        env, mounts = share.client([(device.uuid, min(held, device.replicas))])
        return DeviceEdits(nodes, env, mounts)

    def unprepare(self, claims: Sequence[ClaimKey]) -> dict[str, str]:
        """Per claim UID: "" on success (unknown claims too), else an error message."""
        out: dict[str, str] = {}
        changed = False
        with self._lock:
            for key in claims:
                if key.uid not in self._claims:
                    out[key.uid] = ""
                    self.metrics.unprepares.labels(result="unknown").inc()
                    continue
                claims_left = {u: c for u, c in self._claims.items() if u != key.uid}
                try:
                    self.state.save(claims_left)
                except DraError as e:
                    out[key.uid] = str(e)
                    self.metrics.unprepares.labels(result="error").inc()
                    continue
                self.cdi.remove(key.uid)
                self._claims = claims_left
                out[key.uid] = ""
                changed = True
                self.metrics.unprepares.labels(result="ok").inc()
                log.info("dra.claim.unprepared", claim=f"{key.namespace}/{key.name}", uid=key.uid)
        if changed:
            self.on_change()
        return out

    # ---- claims whose ResourceClaim is gone ----

    def release(self, gone: Sequence[tuple[PreparedClaim, str]]) -> list[str]:
        """Release each (claim as it was read, why) still prepared as it was read: the lookup that found it gone
        ran without the lock, and an unprepare or a restart of the same claim meanwhile must not be undone.
        Returns the UIDs released; a state that cannot be saved raises StateError and releases none."""
        with self._lock:
            released = self._release_locked(gone)
        if released:
            self.on_change()
        return released

    def _release_locked(self, gone: Sequence[tuple[PreparedClaim, str]]) -> list[str]:
        drop = {c.uid: why for c, why in gone if self._claims.get(c.uid) == c}
        if not drop:
            return []
        claims_left = {u: c for u, c in self._claims.items() if u not in drop}
        self.state.save(claims_left)
        for uid, why in drop.items():
            claim = self._claims[uid]
            self.cdi.remove(uid)
            self.metrics.released.inc()
            log.warning("dra.claim.released", claim=f"{claim.namespace}/{claim.name}", uid=uid, why=why,
                        devices=[d.device for d in claim.devices])
        self._claims = claims_left
        return list(drop)

    def _release_gone(self, uids: Sequence[str]) -> bool:
        """Look up the holders a prepare clashed with (lock held) and release those gone; True if any was."""
        holders = [self._claims[u] for u in uids[:MAX_HOLDER_LOOKUPS] if u in self._claims]
        gone = [(c, f.why) for c in holders if (f := judge(c, self.get_claim)).verdict is Verdict.GONE]
        return bool(gone) and bool(self._release_locked(gone))

    # ---- health ----

    def set_health(self, gpu_ids: Iterable[str], healthy: bool, reason: str = "reported by the health monitor") -> None:
        """Mark GPUs (UUIDs or indices as strings) healthy or not; republish and tell health streams on change."""
        index = {g.id: g.index for g in self.catalog.topology.gpus}
        index.update({str(g.index): g.index for g in self.catalog.topology.gpus})
        with self._lock:
            changed = False
            for x in gpu_ids:
                g = index.get(x)
                if g is None:
                    log.warning("dra.health.unknown_gpu", gpu=x)
                    continue
                if healthy and g in self._unhealthy:
                    del self._unhealthy[g]
                    changed = True
                elif not healthy and g not in self._unhealthy:
                    self._unhealthy[g] = reason
                    changed = True
            if changed:
                self._health_serial += 1
                self._health_cond.notify_all()
                held = [d for c in self._claims.values() for d in c.devices
                        if d.device in self.catalog.devices
                        and not set(self.catalog.devices[d.device].gpus).isdisjoint(self._unhealthy)]
                if held and not healthy:
                    log.warning("dra.health.prepared_device_unhealthy", devices=[d.device for d in held])
        if changed:
            self.metrics.health_transitions.labels(to="healthy" if healthy else "unhealthy").inc()
            self.on_change()

    def set_instance_health(self, uuids: Iterable[str], healthy: bool,
                            reason: str = "reported by the health monitor") -> None:
        """Mark MIG instances (by MIG UUID) healthy or not: the health monitor's on_instance_change."""
        by_uuid = {d.uuid: n for n, d in self.catalog.devices.items() if d.kind == "mig"}
        changed = False
        with self._lock:
            for u in uuids:
                name = by_uuid.get(u)
                if name is None:
                    log.warning("dra.health.unknown_instance", uuid=u)
                elif healthy and name in self._sick_instances:
                    del self._sick_instances[name]
                    changed = True
                elif not healthy and name not in self._sick_instances:
                    self._sick_instances[name] = reason
                    changed = True
            if changed:
                self._health_serial += 1
                self._health_cond.notify_all()
        if changed:
            self.metrics.health_transitions.labels(to="healthy" if healthy else "unhealthy").inc()
            self.on_change()

    def device_health(self) -> list[tuple[str, bool, str]]:
        """(device, healthy, message) for every device, in catalog order."""
        with self._lock:
            out = []
            for name, d in self.catalog.devices.items():
                sick = [g for g in d.gpus if g in self._unhealthy]
                msg = "; ".join(f"GPU {g}: {self._unhealthy[g]}" for g in sick)
                if name in self._sick_instances:
                    msg = f"MIG instance {d.uuid}: {self._sick_instances[name]}"
                out.append((name, not sick and name not in self._sick_instances, msg[:1024]))
            return out

    @property
    def health_serial(self) -> int:
        with self._lock:
            return self._health_serial

    def wait_health_change(self, serial: int, timeout: float) -> int:
        """Block until the health serial passes `serial` (or timeout); return the current serial."""
        with self._health_cond:
            self._health_cond.wait_for(lambda: self._health_serial != serial, timeout)
            return self._health_serial
