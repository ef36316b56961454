"""The DRA driver's node-side logic: prepare and unprepare claims, GPU health, and what to publish. No gRPC, no
Kubernetes client: the claim getter and the change callback are handed in.

- Prepare is idempotent (a prepared claim answers from the state file) and all-or-nothing per claim: nothing is
  written unless every check passed, and the CDI spec is removed again if the state cannot be saved.
- A claim whose devices would share a GPU with another prepared claim is refused: the allocator should never do
  that, and if a republish ever let it, this is the last line that keeps a GPU from being handed out twice.
- Unprepare of an unknown claim succeeds (the kubelet may repeat it, after our restart or the claim's deletion).
- A GPU turning unhealthy taints the devices holding it (republished) and shows in the health stream; claims
  already prepared keep their devices (the kubelet decides about running pods); new prepares of it are refused.
Calls are serialised, as the Go helper does by default.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import structlog

from gpuplugin.dra.catalog import Catalog
from gpuplugin.dra.cdi import CdiWriter
from gpuplugin.dra.claims import our_config, our_results
from gpuplugin.dra.errors import ClaimError, DraError
from gpuplugin.dra.metrics import DraMetrics
from gpuplugin.dra.state import PreparedClaim, PreparedDevice, StateFile

log = structlog.get_logger(__name__)

ClaimGetter = Callable[[str, str], Mapping]  # (namespace, name) -> ResourceClaim dict; raises on failure


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
    ) -> None:
        self.catalog = catalog
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
        self._claims = state.load()
        self._check_loaded()
        stale = cdi.remove_all_but(self._claims)
        if stale:
            log.warning("dra.cdi.removed_stale", claims=stale)

    def _check_loaded(self) -> None:
        ids = self.catalog.topology.ids
        for claim in self._claims.values():
            for d in claim.devices:
                members = self.catalog.devices.get(d.device)
                now = tuple(ids[g] for g in members.gpus) if members else None
                if now != d.gpus:
                    log.error("dra.state.mismatch", claim=claim.uid, device=d.device, recorded=d.gpus,
                              now=now, why="the topology changed under a prepared claim")

    # ---- state for the publisher ----

    def used_gpus(self) -> set[int]:
        with self._lock:
            return self.catalog.gpus_of(d.device for c in self._claims.values() for d in c.devices
                                        if d.device in self.catalog.devices)

    def unhealthy_gpus(self) -> set[int]:
        with self._lock:
            return set(self._unhealthy)

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
                    out[key.uid] = self._prepare_one(key)
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
        results = our_results(claim, key.uid, self.driver_name, self.pool, self.catalog.devices)
        env = our_config(claim, self.driver_name)
        gpus = [g for r in results for g in self.catalog.devices[r.device].gpus]
        if len(gpus) != len(set(gpus)):
            raise ClaimError(f"claim {key.namespace}/{key.name} is allocated devices that share GPUs")
        held = {g: c for c in self._claims.values() for d in c.devices if d.device in self.catalog.devices
                for g in self.catalog.devices[d.device].gpus}
        clash = sorted({held[g].namespace + "/" + held[g].name for g in gpus if g in held})
        if clash:
            raise ClaimError(f"claim {key.namespace}/{key.name} is allocated GPUs {sorted(set(gpus) & set(held))} "
                             f"that claim(s) {', '.join(clash)} hold: refusing to hand a GPU out twice")
        sick = sorted(g for g in gpus if g in self._unhealthy)
        if sick:
            why = "; ".join(f"GPU {g} ({self.catalog.topology.gpus[g].id}): {self._unhealthy[g]}" for g in sick)
            raise ClaimError(f"claim {key.namespace}/{key.name} is allocated unhealthy GPUs: {why}")
        by_device: dict[str, list[str]] = {}
        for r in results:
            by_device.setdefault(r.device, [])
            if r.request not in by_device[r.device]:
                by_device[r.device].append(r.request)
        ids = self.catalog.topology.ids
        devices = []
        for name, requests in by_device.items():
            members = self.catalog.devices[name].gpus
            cdi_ids = [self.cdi.device_id(key.uid, name)]
            if self.nvidia_cdi:
                cdi_ids += [f"nvidia.com/gpu={ids[g]}" for g in members]
            devices.append(PreparedDevice(tuple(requests), self.pool, name, tuple(ids[g] for g in members),
                                          tuple(cdi_ids)))
        minors = {name: [self.minors.get(g, g) for g in self.catalog.devices[name].gpus] for name in by_device}
        self.cdi.write(key.uid, minors, env)
        claims = dict(self._claims)
        claims[key.uid] = PreparedClaim(key.uid, key.namespace, key.name, tuple(devices))
        try:
            self.state.save(claims)
        except DraError:
            self.cdi.remove(key.uid)
            raise
        self._claims = claims
        log.info("dra.claim.prepared", claim=f"{key.namespace}/{key.name}", uid=key.uid,
                 devices=list(by_device))
        return tuple(devices)

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

    def device_health(self) -> list[tuple[str, bool, str]]:
        """(device, healthy, message) for every device, in catalog order."""
        with self._lock:
            out = []
            for name, d in self.catalog.devices.items():
                sick = [g for g in d.gpus if g in self._unhealthy]
                msg = "; ".join(f"GPU {g}: {self._unhealthy[g]}" for g in sick)
                out.append((name, not sick, msg[:1024]))
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
