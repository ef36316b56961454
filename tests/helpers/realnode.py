"""Simulated GPU nodes on a real control plane (tests/helpers/controlplane.py): the plugin process as it runs on a
node (`gpuplugin run` with the control plane's kubeconfig), the kubelet simulator it registers with, the kubelet's
PodResources service, and sim.admission admitting the pods bound to the node as the kubelet does. The Node starts
as a kubelet leaves it (Ready, no GPUs); the plugin publishes its topology and state, the admission its capacity.
On exit the Node is deleted, so a node of one test never takes another test's pods. `publish_delay_s` starts the
plugin that much later while the Node is already up (Ready, no GPUs): the window an autoscaler sees on a new node.

    with real_gpu_node(cp, "gpu-a", topology=DGX1) as node:
        node.wait_published(30)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputopo.contract import DEFAULT_KEYS
from gputopo.kube.client import make_api_client
from sim.admission import KubeletAdmission
from sim.kubelet import KubeletSimulator
from sim.podresources import PodResourcesServer
from sim.ports import free_port
from tests.helpers.controlplane import ControlPlane, wait_until
from tests.helpers.paths import short_dir
from tests.helpers.processes import stop_process

# argv[1] seconds later, the same process becomes argv[2:] (one pid throughout, so stop_process stops either)
_EXEC_LATER = "import os, sys, time; time.sleep(float(sys.argv[1])); os.execv(sys.argv[2], sys.argv[2:])"


@dataclass
class RealGpuNode:
    name: str
    cp: ControlPlane
    kubelet: KubeletSimulator
    podres: PodResourcesServer
    admission: KubeletAdmission
    process: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def node(self) -> dict[str, Any]:
        return self.cp.request("GET", f"/api/v1/nodes/{self.name}")  # type: ignore[no-any-return]

    def wait_published(self, resource: str, count: int, timeout: float) -> None:
        """Until the Node carries the plugin's topology or state and `count` allocatable `resource` (a bound on
        a liveness wait, not a figure)."""
        def ready() -> bool:
            node = self.node()
            annotations = node["metadata"].get("annotations") or {}
            return (DEFAULT_KEYS.state in annotations
                    and node["status"].get("allocatable", {}).get(resource) == str(count))
        try:
            wait_until(f"{self.name} published", ready, timeout)
        except Exception as e:
            raise AssertionError(f"{e}; plugin log: {self.log_tail()}") from None


@contextmanager
def real_gpu_node(cp: ControlPlane, name: str, *, topology: Path | None = None, nvml_recording: Path | None = None,
                  args: Sequence[str] = (), labels: Mapping[str, str] | None = None, start_delay_s: float = 0.0,
                  seed: int = 0, publish_delay_s: float = 0.0) -> Iterator[RealGpuNode]:
    source = ["--topology", str(topology)] if topology is not None else ["--nvml-recording", str(nvml_recording)]
    with short_dir("rnode-") as root, PodResourcesServer(str(root / "podres.sock")) as podres, \
            KubeletSimulator(root / "dp") as kubelet:
        cp.add_node(name, labels=labels)
        env = dict(os.environ, KUBECONFIG=str(cp.kubeconfig), NODE_NAME=name, PYTHONUNBUFFERED="1")
        argv = [sys.executable, "-m", "gpuplugin.cli", "run", "--device-plugin-dir", str(root / "dp"), *source,
                "--pod-resources-socket", str(root / "podres.sock"), "--metrics-port", str(free_port()),
                "--pod-resources-poll-interval", "0.5", *args]
        if publish_delay_s > 0:
            argv = [sys.executable, "-c", _EXEC_LATER, str(publish_delay_s), *argv]
        log = root / "plugin.log"
        with open(log, "wb") as out:
            process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        api = make_api_client(kubeconfig=str(cp.kubeconfig))
        admission = KubeletAdmission(api, name, kubelet, podres.service, start_delay_s=start_delay_s, seed=seed)
        node = RealGpuNode(name, cp, kubelet, podres, admission.start(), process, log)
        try:
            yield node
        finally:
            admission.stop()
            stop_process(process, log=log)
            api.close()
            cp.request("DELETE", f"/api/v1/nodes/{name}", ok=(200, 202, 404))


def plan_of(pod: Mapping[str, Any]) -> dict[str, Any] | None:
    text = ((pod.get("metadata") or {}).get("annotations") or {}).get(DEFAULT_KEYS.plan)
    return json.loads(text) if text else None


def install_crd(cp: ControlPlane, group: str, version: str, plural: str, kind: str, timeout: float = 60.0) -> None:
    """A namespaced CustomResourceDefinition that keeps whatever its objects hold (the operators' real schemas are
    not needed to make their objects), served once this returns."""
    crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
           "metadata": {"name": f"{plural}.{group}"},
           "spec": {"group": group, "scope": "Namespaced",
                    "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
                    "versions": [{"name": version, "served": True, "storage": True,
                                  "schema": {"openAPIV3Schema": {"type": "object",
                                                                 "x-kubernetes-preserve-unknown-fields": True}},
                                  "subresources": {"status": {}}}]}}
    cp.request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd, ok=(201, 409))
    wait_until(f"{kind} served", lambda: cp.api().get(f"/apis/{group}/{version}/{plural}").status_code == 200,
               timeout)
