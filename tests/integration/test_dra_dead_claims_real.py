"""A claim the DRA driver prepared and then lost without an unprepare (the kubelet's checkpoint lost) no longer
holds its GPUs, against the real kube-apiserver, kube-controller-manager and kube-scheduler v1.36.2: the
`gpuplugin dra` process publishes a DGX-1's pool, the real scheduler allocates a claim for all 8 GPUs (the only
8-GPU set, so the next such claim gets the same GPUs), the kubelet stand-in (sim.dra_kubelet) prepares it, and
the claim is deleted with no unprepare:
- while the driver is down (SIGKILL between prepare and unprepare): the restarted driver releases it;
- while the driver runs: its timer releases it.
Either way state.json and the CDI spec lose it, and the next claim the scheduler gives the same GPUs prepares.

Skips, naming why, where the Kubernetes binaries (shared/kube beside the clone) or etcd are absent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sim.dra_kubelet import DraKubeletSim
from tests.helpers.controlplane import ControlPlane, tidied
from tests.helpers.dra_nodes import install_classes
from tests.helpers.paths import SHARED, short_dir
from tests.helpers.polling import eventually
from tests.helpers.processes import stop_process

pytestmark = [pytest.mark.timeout(300)]

DRIVER = "gpu-topology.io"
DRA = "/apis/resource.k8s.io/v1"
NAMESPACE = "dra-dead-claims"
DGX1 = SHARED / "topologies" / "dgx1-v100-ucxpy.txt"
ALL_EIGHT = "set-0-1-2-3-4-5-6-7"
WAIT_S = 60.0  # liveness bound of one step on a loaded 2-core machine, never a performance figure


@dataclass
class Node:
    cp: ControlPlane
    name: str
    root: Path
    kubelet: DraKubeletSim
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.root / "driver.log"

    def start_driver(self) -> None:
        """`gpuplugin dra` on this node's directories; returns once the kubelet stand-in registered it anew."""
        old = self.kubelet.plugins.get(DRIVER)
        env = dict(os.environ, KUBECONFIG=str(self.cp.kubeconfig), NODE_NAME=self.name,
                   GPUPLUGIN_DRA_RECONCILE_INTERVAL="1")
        args = [sys.executable, "-m", "gpuplugin.cli", "dra", "--topology", str(DGX1),
                "--registry-dir", str(self.root / "registry"), "--plugin-dir", str(self.root / "plugin"),
                "--cdi-dir", str(self.root / "cdi"), "--metrics-port", "0", "--min-publish-interval", "0",
                "--log-level", "info"]
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.wait("the driver registered", lambda: self.proc is not None and self.proc.poll() is None and
                  self.kubelet.plugins.get(DRIVER) not in (None, old))
        self.wait("the driver's pool published", self._pool_complete)

    def wait(self, what: str, check: Callable[[], object]) -> None:
        assert eventually(check, WAIT_S), f"{what}: not after {WAIT_S} s; the driver's log:\n{self.diagnosis()}"

    def kill_driver(self) -> None:
        assert self.proc is not None
        self.proc.kill()  # SIGKILL: no unprepare, no cleanup, state.json as it was
        self.proc.wait(WAIT_S)

    def _pool_complete(self) -> bool:
        slices = self.cp.list_items(f"{DRA}/resourceslices", fieldSelector=f"spec.nodeName={self.name}")
        gens = {s["spec"]["pool"]["generation"] for s in slices}
        return bool(slices) and len(gens) == 1 and len(slices) == slices[0]["spec"]["pool"]["resourceSliceCount"]

    def held(self) -> set[str]:
        path = self.root / "plugin" / "state.json"
        return set(json.loads(path.read_text())["claims"]) if path.exists() else set()

    def cdi(self, uid: str) -> Path:
        return self.root / "cdi" / f"{DRIVER}-claim_{uid}.json"

    def diagnosis(self) -> str:
        return self.log.read_text()[-4000:] if self.log.exists() else "(no driver log)"


@pytest.fixture(scope="module")
def cluster(real_control_plane: ControlPlane) -> Iterator[ControlPlane]:
    with tidied(real_control_plane) as cp:
        install_classes(cp, NAMESPACE)
        cp.start_scheduler()
        yield cp


@pytest.fixture
def node(cluster: ControlPlane, request: pytest.FixtureRequest) -> Iterator[Node]:
    """A Node of its own per test (its pool, claims and driver directories), the driver started on it."""
    name = f"dead-{request.node.name.split('_')[-1]}"
    with short_dir("dradead-") as root, DraKubeletSim(root / "registry", name) as kubelet:
        cluster.add_node(name, labels={f"{DRIVER}/gpu-mode": "dra"})
        n = Node(cluster, name, root, kubelet)
        try:
            n.start_driver()
            yield n
        finally:
            if n.proc is not None and n.proc.poll() is None:
                stop_process(n.proc, WAIT_S)


def _claim_and_pod(n: Node, name: str) -> str:
    """A claim for an 8-GPU set and a pod on `n` using it; returns the claim's uid once the real scheduler
    allocated it and reserved it for the pod."""
    cp = n.cp
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
             "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {
                 "deviceClassName": "gpu-set-8.gpu-topology.io"}}]}}}
    uid: str = cp.request("POST", f"{DRA}/namespaces/{NAMESPACE}/resourceclaims", claim)["metadata"]["uid"]
    pod = {"metadata": {"name": name},
           "spec": {"nodeSelector": {"kubernetes.io/hostname": n.name},
                    "resourceClaims": [{"name": "gpus", "resourceClaimName": name}],
                    "containers": [{"name": "main", "image": "registry.invalid/none:0",
                                    "resources": {"claims": [{"name": "gpus"}]}}],
                    "terminationGracePeriodSeconds": 0}}
    cp.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", pod)

    def allocated() -> dict[str, Any] | None:
        got = cp.request("GET", f"{DRA}/namespaces/{NAMESPACE}/resourceclaims/{name}")
        status = got.get("status") or {}
        return got if status.get("allocation") and status.get("reservedFor") else None

    n.wait(f"claim {name} allocated and reserved", allocated)
    results = cp.request("GET", f"{DRA}/namespaces/{NAMESPACE}/resourceclaims/{name}")["status"]["allocation"][
        "devices"]["results"]
    assert [(r["driver"], r["pool"], r["device"]) for r in results] == [(DRIVER, n.name, ALL_EIGHT)], results
    return uid


def _delete_without_unprepare(n: Node, name: str) -> None:
    """The pod goes (forced: no kubelet confirms), then the claim; kube-controller-manager drops the pod from the
    claim's reservedFor, deallocates it and lifts its finalizer, and the claim is gone."""
    cp = n.cp
    cp.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}", ok=(200, 202, 404), gracePeriodSeconds=0)
    cp.request("DELETE", f"{DRA}/namespaces/{NAMESPACE}/resourceclaims/{name}", ok=(200, 202, 404))
    path = f"{DRA}/namespaces/{NAMESPACE}/resourceclaims/{name}"
    n.wait(f"claim {name} gone", lambda: cp.api().get(path).status_code == 404)


def _prepares(n: Node, name: str, uid: str) -> None:
    (device,) = n.kubelet.prepare(DRIVER, [(NAMESPACE, uid, name)])[uid]
    assert device.device_name == ALL_EIGHT
    assert n.held() >= {uid} and n.cdi(uid).exists()


def _released(n: Node, uid: str, how: str) -> None:
    """The driver dropped `uid` from state.json and its CDI spec, and said why in its log."""
    n.wait(f"the {how} driver released the deleted claim {uid}", lambda: uid not in n.held())
    assert not n.cdi(uid).exists(), n.diagnosis()
    n.wait("the release logged", lambda: any(
        '"dra.claim.released"' in line and uid in line for line in n.log.read_text().splitlines()))


def test_a_claim_deleted_while_the_driver_is_killed_is_released_when_it_starts(node: Node) -> None:
    first, second = f"{node.name}-first", f"{node.name}-second"
    uid = _claim_and_pod(node, first)
    _prepares(node, first, uid)
    node.kill_driver()
    _delete_without_unprepare(node, first)
    node.start_driver()
    _released(node, uid, "restarted")
    again = _claim_and_pod(node, second)  # the real scheduler gives it the same 8 GPUs
    _prepares(node, second, again)
    assert node.held() == {again}


def test_a_claim_deleted_while_the_driver_runs_is_released_by_its_timer(node: Node) -> None:
    first, second = f"{node.name}-first", f"{node.name}-second"
    uid = _claim_and_pod(node, first)
    _prepares(node, first, uid)
    _delete_without_unprepare(node, first)
    _released(node, uid, "running")
    again = _claim_and_pod(node, second)
    _prepares(node, second, again)
    assert node.held() == {again}
