"""The plugin killed while the kubelet is admitting pods, and started again as the DaemonSet's container restart
would: a harness shared by tests/integration/test_plugin_crash_real.py (a few kill points) and bench/plugin_crash.py
(the sweep).

A real control plane (tests/helpers/controlplane.py), a real `gpuplugin run` process, the kubelet simulator
admitting the pods bound to the node from the apiserver (sim.admission), and the kubelet's PodResources. Each kill
point is one round: N pods, each with an extender plan (the `<prefix>/plan` annotation, disjoint plans that fill the
node), are bound to the node at once; the plugin gets the signal `delay_s` after the kubelet starts its k-th Allocate
call of the round (so in flight, just before or just after it, as the delay falls; a frozen kill point stops the
plugin as that call starts, so the call is surely in flight when the signal lands), and is started again once it
has exited.

The real kubelet does not retry a pod whose admission failed: a pod whose Allocate was cut, or that arrived while
the plugin was away (no healthy devices), ends Failed with reason UnexpectedAdmissionError, and its owner (a Job,
a ReplicaSet, a StatefulSet) makes a new one. `StatefulController` plays that owner here: it recreates a failed pod
under the same name with the same plan once the plugin is back. A pod is stranded when it is neither admitted nor
failed (admission hung), or when its replacement is not admitted after the restart.

After the restart, each round checks: no device id held by two pods (PodResources), every pod admitted, the Node's
published state (used GPUs, none unhealthy, the topology beside it) equal to what PodResources lists, and every pod
whose planned GPUs were free when the kubelet admitted it holding exactly its plan.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuplugin.proto.podresources.v1 import api_pb2 as podres_pb
from gputopo.contract import DEFAULT_KEYS
from gputopo.core import state_from_json
from gputopo.kube.client import make_api_client
from sim.admission import Admitted, KubeletAdmission
from sim.kubelet import KubeletSimulator
from sim.podresources import FakePodResources, PodResourcesServer
from sim.ports import free_port
from tests.helpers.controlplane import ControlPlane
from tests.helpers.kube import k8s_pod
from tests.helpers.paths import SHARED, short_dir
from tests.helpers.polling import eventually
from tests.helpers.processes import stop_process

RESOURCE = "nvidia.com/gpu"
DGX1 = SHARED / "topologies" / "dgx1-v100-ucxpy.txt"
# Disjoint 2-GPU plans filling the 8-GPU node, none of them the plugin's own first choice for 2 GPUs (0,3): a pod
# holding its plan got it from the plan, not by chance.
PLANS: tuple[tuple[str, ...], ...] = (("1", "6"), ("2", "5"), ("0", "7"), ("3", "4"))
WAIT = 60.0  # liveness bound of every wait, never a figure


class CountingKubelet(KubeletSimulator):
    """The kubelet simulator, calling `on_allocate(n)` as its n-th Allocate call starts (before the RPC)."""

    def __init__(self, plugin_dir: Path) -> None:
        super().__init__(plugin_dir)
        self.allocate_calls = 0
        self.on_allocate: Callable[[int], None] | None = None
        self._count_lock = threading.Lock()

    def allocate(self, resource: str, ids: Sequence[str]) -> Any:
        with self._count_lock:
            self.allocate_calls += 1
            n, hook = self.allocate_calls, self.on_allocate
        if hook is not None:
            hook(n)
        return super().allocate(resource, ids)


class RecordingAdmission(KubeletAdmission):
    """sim.admission, noting which devices were free (healthy, held by no pod) when each pod's container was
    allocated: a plan is owed only where its GPUs were free then."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.free_at_admission: dict[str, frozenset[str]] = {}  # "ns/name" -> free ids at its latest admission

    def _allocate(self, admitted: Admitted, container: str, resource: str, count: int) -> None:
        held = {i for ids in self.held(resource).values() for i in ids}
        free = frozenset(d.id for d in self._kubelet.devices(resource) if d.healthy and d.id not in held)
        self.free_at_admission[f"{admitted.namespace}/{admitted.name}"] = free
        super()._allocate(admitted, container, resource, count)


@dataclass
class KillPoint:
    """Signal the plugin `delay_s` after the kubelet starts the `k`-th Allocate call of a round. `frozen`: the
    plugin is stopped (SIGSTOP) as that call starts and gets the signal, then SIGCONT, `delay_s` later, so the call
    is surely in flight when the signal lands (unfrozen, it may land before the call arrives or after it was
    answered, as the timing falls)."""

    k: int
    delay_s: float
    sig: signal.Signals
    frozen: bool = False


@dataclass
class RoundResult:
    point: KillPoint
    killed: bool = False
    exit_code: int | None = None
    cut_pods: int = 0  # pods that failed admission (cut Allocate, or no plugin) and were replaced
    allocate_cut: int = 0  # of them, pods whose Allocate call itself failed (the signal caught it in flight)
    double_given: list[str] = field(default_factory=list)  # device ids held by two pods
    stranded: list[str] = field(default_factory=list)  # pods never admitted
    state_mismatch: str = ""  # the Node's published used GPUs against PodResources, when they differ
    plan_violations: list[str] = field(default_factory=list)
    registration_s: float | None = None  # plugin start -> the kubelet accepted its registration
    devices_s: float | None = None  # plugin start -> the kubelet holds every device Healthy again

    @property
    def ok(self) -> bool:
        return (self.killed and not self.double_given and not self.stranded and not self.state_mismatch
                and not self.plan_violations and self.registration_s is not None)

    def as_dict(self) -> dict[str, Any]:
        return {"k": self.point.k, "delay_ms": round(self.point.delay_s * 1000, 3), "signal": self.point.sig.name,
                "frozen": self.point.frozen,
                "killed": self.killed, "exit_code": self.exit_code, "cut_pods": self.cut_pods,
                "allocate_cut": self.allocate_cut,
                "double_given": self.double_given, "stranded": self.stranded, "state_mismatch": self.state_mismatch,
                "plan_violations": self.plan_violations, "registration_s": self.registration_s,
                "devices_s": self.devices_s}


def podresources_held(service: FakePodResources) -> dict[str, list[str]]:
    """What the kubelet's PodResources List says: device ids of RESOURCE per pod ("ns/name")."""
    listed = service.List(podres_pb.ListPodResourcesRequest(), None)  # type: ignore[arg-type]
    return {f"{p.namespace}/{p.name}": [i for c in p.containers for d in c.devices if d.resource_name == RESOURCE
                                        for i in d.device_ids]
            for p in listed.pod_resources}


def given_twice(held: dict[str, list[str]]) -> list[str]:
    counts = Counter(i for ids in held.values() for i in ids)
    return sorted(i for i, n in counts.items() if n > 1)


class CrashNode:
    """One simulated GPU node whose plugin process can be signalled and started again."""

    def __init__(self, cp: ControlPlane, name: str, root: Path, namespace: str) -> None:
        self.cp, self.name, self.root, self.namespace = cp, name, root, namespace
        self.log = root / "plugin.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.podres = PodResourcesServer(str(root / "podres.sock"))
        self.kubelet = CountingKubelet(root / "dp")
        self._api = make_api_client(kubeconfig=str(cp.kubeconfig))
        self.admission = RecordingAdmission(self._api, name, self.kubelet, self.podres.service)
        self.metrics_port = free_port()
        self.starts = 0

    def open(self) -> CrashNode:
        self.podres.__enter__()
        self.kubelet.start()
        self.cp.add_node(self.name)
        self.cp.ensure_namespace(self.namespace)
        self.admission.start()
        return self

    def close(self) -> None:
        self.admission.stop()
        if self.process is not None:
            stop_process(self.process, log=self.log)
        self.kubelet.stop()
        self.podres.__exit__()
        self._api.close()
        self.cp.request("DELETE", f"/api/v1/namespaces/{self.namespace}/pods", ok=(200, 404), gracePeriodSeconds=0)
        self.cp.request("DELETE", f"/api/v1/nodes/{self.name}", ok=(200, 202, 404))

    # -- the plugin process ------------------------------------------------------------------------------------

    def start_plugin(self) -> float:
        """Start `gpuplugin run` (appending to one log over all its lives); returns time.monotonic() at the start."""
        env = dict(os.environ, KUBECONFIG=str(self.cp.kubeconfig), NODE_NAME=self.name, PYTHONUNBUFFERED="1")
        argv = [sys.executable, "-m", "gpuplugin.cli", "run", "--device-plugin-dir", str(self.root / "dp"),
                "--topology", str(DGX1), "--device-id-strategy", "index",
                "--pod-resources-socket", str(self.root / "podres.sock"), "--metrics-port", str(self.metrics_port),
                "--pod-resources-poll-interval", "0.5"]
        self.starts += 1
        started = time.monotonic()
        with open(self.log, "ab") as out:
            out.write(f'{{"event": "crash-harness.start", "life": {self.starts}}}\n'.encode())
            out.flush()
            self.process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        return started

    def signal_plugin(self, *sigs: signal.Signals) -> None:
        if self.process is not None and self.process.poll() is None:
            for sig in sigs:
                os.kill(self.process.pid, sig)

    def wait_exit(self, timeout: float) -> int | None:
        assert self.process is not None
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def wait_registered(self, started: float, timeout: float) -> tuple[float | None, float | None]:
        """(start -> registration accepted, start -> every device Healthy in the kubelet), None where not seen."""
        registered: list[float] = []

        def accepted() -> bool:
            registered[:] = [t for t in self.kubelet.registration_times(RESOURCE) if t >= started]
            return bool(registered)
        if not eventually(accepted, timeout, interval=0.002):
            return None, None
        reg = registered[0] - started
        try:
            self.kubelet.wait_for_devices(RESOURCE, 8, timeout)
        except TimeoutError:
            return reg, None
        return reg, time.monotonic() - started

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    # -- pods ------------------------------------------------------------------------------------------------

    def pod_manifest(self, name: str, plan: Sequence[str]) -> dict[str, Any]:
        text = json.dumps({"v": 1, "node": self.name, "resource": RESOURCE, "containers": {"main": list(plan)},
                           "gbps": 1.0})
        return k8s_pod(name, len(plan), self.name, {DEFAULT_KEYS.plan: text}, namespace=self.namespace)

    def create_pod(self, name: str, plan: Sequence[str]) -> None:
        self.cp.request("POST", f"/api/v1/namespaces/{self.namespace}/pods", self.pod_manifest(name, plan))

    def pods(self) -> list[dict[str, Any]]:
        return self.cp.list_items(f"/api/v1/namespaces/{self.namespace}/pods")

    def delete_pods(self, timeout: float) -> bool:
        """Every pod of the namespace gone, from the apiserver and from PodResources."""
        self.cp.request("DELETE", f"/api/v1/namespaces/{self.namespace}/pods", ok=(200, 404), gracePeriodSeconds=0)
        return eventually(lambda: not self.pods() and not podresources_held(self.podres.service), timeout, 0.05)

    def published(self) -> tuple[frozenset[str], frozenset[str]] | None:
        """(used, unhealthy) of the plugin's state annotation on the Node; None without it or its topology."""
        annotations = (self.cp.request("GET", f"/api/v1/nodes/{self.name}").get("metadata") or {}).get(
            "annotations") or {}
        raw = annotations.get(DEFAULT_KEYS.state)
        if not raw or DEFAULT_KEYS.topology not in annotations:
            return None
        state = state_from_json(raw)
        return frozenset(state.used), frozenset(state.unhealthy)


class StatefulController:
    """The pods' owner: a pod that failed admission is deleted and made again under its name with its plan (a
    StatefulSet's behaviour; a ReplicaSet's differs only by the new name). Returns how many it replaced."""

    def __init__(self, node: CrashNode, plans: dict[str, Sequence[str]]) -> None:
        self.node, self.plans = node, plans
        self.replaced = 0

    def sweep(self) -> None:
        for pod in self.node.pods():
            name = pod["metadata"]["name"]
            if (pod.get("status") or {}).get("phase") == "Failed" and name in self.plans:
                ns = self.node.namespace
                self.node.cp.request("DELETE", f"/api/v1/namespaces/{ns}/pods/{name}", ok=(200, 404),
                                     gracePeriodSeconds=0)
                if eventually(lambda path=f"/api/v1/namespaces/{ns}/pods/{name}": self.node.cp.request(
                        "GET", path, ok=(200, 404)).get("kind") != "Pod", WAIT):
                    self.node.create_pod(name, self.plans[name])
                    self.replaced += 1

    def missing(self) -> list[str]:
        """Pods of the round not (yet) Running and admitted by the kubelet."""
        running = {p["metadata"]["name"] for p in self.node.pods() if (p.get("status") or {}).get("phase") == "Running"}
        held = self.node.admission.held(RESOURCE)
        return sorted(n for n in self.plans if n not in running or f"{self.node.namespace}/{n}" not in held)


@contextmanager
def crash_node(cp: ControlPlane, name: str, namespace: str) -> Iterator[CrashNode]:
    with short_dir("crash-") as root:
        node = CrashNode(cp, name, root, namespace).open()
        try:
            yield node
        finally:
            node.close()


def run_round(node: CrashNode, round_no: int, point: KillPoint, *, timeout: float = WAIT) -> RoundResult:
    """One kill point: plugin healthy and node empty on entry, plugin registered again and pods deleted on exit."""
    result = RoundResult(point)
    plans = {f"r{round_no}-p{i}": plan for i, plan in enumerate(PLANS)}
    base = node.kubelet.allocate_calls
    rejected_before = set(node.admission.rejected)
    fired = threading.Event()

    def on_allocate(n: int) -> None:
        if n - base == point.k and not fired.is_set():
            fired.set()
            if point.frozen:
                node.signal_plugin(signal.SIGSTOP)
                threading.Timer(point.delay_s, node.signal_plugin, (point.sig, signal.SIGCONT)).start()
            else:
                threading.Timer(point.delay_s, node.signal_plugin, (point.sig,)).start()
    node.kubelet.on_allocate = on_allocate
    try:
        for name, plan in plans.items():
            node.create_pod(name, plan)
        if not fired.wait(timeout):
            return result
    finally:
        node.kubelet.on_allocate = None
    result.exit_code = node.wait_exit(timeout)
    result.killed = result.exit_code is not None
    if not result.killed:
        return result
    started = node.start_plugin()  # the container restart: at once, no crash-loop backoff on a first failure
    result.registration_s, result.devices_s = node.wait_registered(started, timeout)

    controller = StatefulController(node, plans)

    def settled() -> bool:
        controller.sweep()
        return not controller.missing()
    eventually(settled, timeout, interval=0.1)
    result.stranded = controller.missing()
    result.cut_pods = controller.replaced
    result.allocate_cut = sum(why.startswith("Allocate failed") for uid, why in list(node.admission.rejected.items())
                              if uid not in rejected_before)

    held = podresources_held(node.podres.service)
    result.double_given = given_twice(held)
    expected = frozenset(i for ids in held.values() for i in ids)
    if not eventually(lambda: node.published() == (expected, frozenset()), timeout):
        result.state_mismatch = f"published (used, unhealthy) {node.published()}, PodResources {sorted(expected)}"
    for name, plan in plans.items():
        key = f"{node.namespace}/{name}"
        free = node.admission.free_at_admission.get(key, frozenset())
        if key in held and set(plan) <= free and sorted(held[key]) != sorted(plan):
            result.plan_violations.append(f"{key}: planned {sorted(plan)} (free at admission), got {held[key]}")
    if not node.delete_pods(timeout):
        result.stranded.append(f"pods of round {round_no} not released: {podresources_held(node.podres.service)}")
    return result
