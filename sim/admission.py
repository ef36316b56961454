"""A node's kubelet admitting pods from a real apiserver, the way the kubelet's device manager does, so the plugin's
GetPreferredAllocation meets the questions it meets on a node.

What a plugin can tell apart is kept as the kubelet does it (pkg/kubelet/kubelet.go HandlePodAdditions,
pkg/kubelet/cm/devicemanager):
- pods bound to the node arrive from a watch; the ones that arrived together are admitted one at a time, oldest
  creationTimestamp first, pods of the same second in no fixed order (the kubelet's sort is not stable);
- a pod is listed in PodResources (sim.podresources) just before its admission, holding nothing, and each container
  holds its devices there from the moment it was allocated;
- containers are allocated in order (init containers, then the others), each resource with one
  GetPreferredAllocation and one Allocate (sim.kubelet: the answer intersected with the available devices, any
  shortfall filled);
- a pod that cannot get its devices fails admission (phase Failed, reason UnexpectedAdmissionError) and holds none;
- an admitted pod turns Running after `start_delay_s` (image pulls keep it Pending for that long);
- a pod that is deleted or ends gives its devices back.
The node's capacity and allocatable of each registered resource follow the plugin's healthy devices, as the kubelet
reports them on the Node.

Init containers' devices are not reused by the app containers here (the kubelet's reuse, with must_include, is
left out); the scenarios that use this give GPUs to app containers only.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import kubernetes.client
import structlog

from gputopo.kube.watching import SYNC, Watcher
from gputopo.podspec import PodSpecError, container_needs
from sim.kubelet import AdmissionError, KubeletSimulator, SimulatorError
from sim.podresources import FakePodResources

log = structlog.get_logger(__name__)

MAX_BATCH = 256  # pods taken off the queue at once, as one update of the kubelet's pod config


class NotAdmitted(Exception):
    """Fewer devices available than a container asks for: the kubelet fails the pod's admission."""


@dataclass
class Admitted:
    """One pod this kubelet admitted: its devices per container and resource."""

    namespace: str
    name: str
    devices: dict[str, dict[str, list[str]]] = field(default_factory=dict)


class KubeletAdmission:
    """Admit the pods bound to `node` with the plugin behind `kubelet`, and keep PodResources and the Node's
    capacity true. `admitted` and `rejected` say what happened, by pod uid."""

    def __init__(self, api: kubernetes.client.ApiClient, node: str, kubelet: KubeletSimulator,
                 podresources: FakePodResources, *, start_delay_s: float = 0.0, seed: int = 0) -> None:
        self.node = node
        self._api = api
        self._core = kubernetes.client.CoreV1Api(api)
        self._kubelet = kubelet
        self._podres = podresources
        self._start_delay = start_delay_s
        self._rng = random.Random(seed)
        self._incoming: queue.Queue[dict[str, Any]] = queue.Queue(maxsize=10_000)
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self.admitted: dict[str, Admitted] = {}
        self.rejected: dict[str, str] = {}  # uid -> why
        self._stop = threading.Event()
        self._capacity: dict[str, int] = {}
        self._watcher = Watcher(api, "pods", self._on_event, field_selector=f"spec.nodeName={node}",
                                backoff_initial_s=0.1, backoff_max_s=2.0, name=f"sim-kubelet-{node}")
        self._threads = [threading.Thread(target=self._admit_loop, name=f"sim-admit-{node}", daemon=True),
                         threading.Thread(target=self._capacity_loop, name=f"sim-capacity-{node}", daemon=True)]

    def start(self) -> KubeletAdmission:
        for t in self._threads:
            t.start()
        self._watcher.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._watcher.stop()
        for t in self._threads:
            t.join(10)

    def __enter__(self) -> KubeletAdmission:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def held(self, resource: str) -> dict[str, list[str]]:
        """Device ids of `resource` per admitted pod ("namespace/name")."""
        with self._lock:
            return {f"{a.namespace}/{a.name}": [i for by in a.devices.values() for i in by.get(resource, [])]
                    for a in self.admitted.values() if any(resource in by for by in a.devices.values())}

    # -- watch -----------------------------------------------------------------------------------------------

    def _on_event(self, event_type: str, obj: dict[str, Any]) -> None:
        pods = (obj.get("items") or []) if event_type == SYNC else [obj]
        for pod in pods:
            meta = pod.get("metadata") or {}
            uid = meta.get("uid")
            if not isinstance(uid, str):
                continue
            phase = (pod.get("status") or {}).get("phase")
            if event_type == "DELETED" or meta.get("deletionTimestamp") or phase in ("Succeeded", "Failed"):
                self._release(uid)
                continue
            with self._lock:
                if uid in self._seen:
                    continue
                self._seen.add(uid)
            self._incoming.put(pod)

    def _release(self, uid: str) -> None:
        with self._lock:
            gone = self.admitted.pop(uid, None)
        if gone is not None:
            self._podres.remove_pod(gone.namespace, gone.name)

    # -- admission -------------------------------------------------------------------------------------------

    def _admit_loop(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._incoming.get(timeout=0.2)
            except queue.Empty:
                continue
            batch = [first]
            while len(batch) < MAX_BATCH:
                try:
                    batch.append(self._incoming.get_nowait())
                except queue.Empty:
                    break
            self._rng.shuffle(batch)  # then a stable sort: pods of the same second in no fixed order
            batch.sort(key=lambda p: (p.get("metadata") or {}).get("creationTimestamp") or "")
            for pod in batch:
                try:
                    self._admit(pod)
                except Exception:  # one pod's trouble must not stop the node
                    log.exception("sim.admission.failed", pod=(pod.get("metadata") or {}).get("name"))

    def _admit(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid, ns, name = meta["uid"], meta.get("namespace", "default"), meta["name"]
        spec = pod.get("spec") or {}
        names = [c.get("name") for f in ("initContainers", "containers") for c in spec.get(f) or []]
        admitted = Admitted(ns, name, {str(c): {} for c in names})
        with self._lock:
            self.admitted[uid] = admitted
        self._podres.set_pod(ns, name, {c: {} for c in admitted.devices})  # listed from just before admission
        try:
            for resource in sorted(self._kubelet.resources()):
                for need in container_needs(pod, resource):
                    if need.count > 0:
                        self._allocate(admitted, need.name, resource, need.count)
        except (AdmissionError, NotAdmitted, SimulatorError, PodSpecError) as e:
            self._release(uid)
            self.rejected[uid] = str(e)
            self._set_phase(ns, name, "Failed", "UnexpectedAdmissionError", str(e)[:500])
            log.info("sim.admission.rejected", pod=f"{ns}/{name}", why=str(e)[:300])
            return
        if self._start_delay > 0:
            threading.Timer(self._start_delay, self._set_phase, (ns, name, "Running")).start()
        else:
            self._set_phase(ns, name, "Running")

    def _allocate(self, admitted: Admitted, container: str, resource: str, count: int) -> None:
        with self._lock:
            taken = {i for a in self.admitted.values() for by in a.devices.values() for i in by.get(resource, [])}
        available = [d.id for d in self._kubelet.devices(resource) if d.healthy and d.id not in taken]
        if count > len(available):
            raise NotAdmitted(f"{resource}: {count} requested, {len(available)} available")
        ids = self._kubelet.preferred(resource, available, [], count)
        self._kubelet.allocate(resource, ids)
        with self._lock:
            admitted.devices.setdefault(container, {})[resource] = list(ids)
            snapshot = {c: dict(by) for c, by in admitted.devices.items()}
        self._podres.set_pod(admitted.namespace, admitted.name, snapshot)

    def _set_phase(self, ns: str, name: str, phase: str, reason: str = "", message: str = "") -> None:
        status: dict[str, Any] = {"phase": phase}
        if reason:
            status.update(reason=reason, message=message)
        try:
            self._core.patch_namespaced_pod_status(name, ns, {"status": status})
        except kubernetes.client.ApiException as e:
            if e.status != 404:  # deleted meanwhile: nothing to say
                log.warning("sim.admission.status_failed", pod=f"{ns}/{name}", status=e.status)

    # -- the Node's capacity ---------------------------------------------------------------------------------

    def _capacity_loop(self) -> None:
        while not self._stop.wait(0.2):
            counts = {r: sum(1 for d in devs if d.healthy) for r, devs in self._kubelet.resources().items()}
            if counts != self._capacity:
                try:
                    self._patch_capacity(counts)
                except kubernetes.client.ApiException as e:
                    log.warning("sim.admission.capacity_failed", status=e.status)
                    continue
                self._capacity = counts

    def _patch_capacity(self, counts: Mapping[str, int]) -> None:
        gone = {r: None for r in self._capacity if r not in counts}
        now = {r: str(n) for r, n in counts.items()}
        body = {"status": {"capacity": {**gone, **now}, "allocatable": {**gone, **now}}}
        self._core.patch_node_status(self.node, body)


def wait_admitted(admission: KubeletAdmission, uids: set[str], timeout: float) -> bool:
    """True once every pod of `uids` was admitted or rejected (a bound on a liveness wait, not a figure)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if uids <= set(admission.admitted) | set(admission.rejected):
            return True
        time.sleep(0.05)
    return False
