"""The plugin process as it runs on a node: `gpuplugin run` with Kubernetes credentials (a kubeconfig pointing at the
in-process API server), the kubelet simulator, and the kubelet's PodResources socket. It must publish the Node's
topology and state, and hand the kubelet the extender's plan for a pod bound to this node."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from gpuplugin.core import state_from_json, topology_from_json
from gpuplugin.sim.kubelet import KubeletSimulator
from tests.conftest import SHARED
from tests.fakes.kubeapi import FakeKubeApi
from tests.publisher.kubelet_podresources import PodResourcesServer

NODE = "dgx1-node"
RESOURCE = "nvidia.com/gpu"
DGX1 = SHARED / "topologies" / "dgx1-v100-ucxpy.txt"


def _wait(pred, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def node_env() -> Iterator[dict]:
    root = Path(tempfile.mkdtemp(prefix="node-", dir="/tmp"))
    with FakeKubeApi() as fake, PodResourcesServer(str(root / "podres.sock")) as podres, \
            KubeletSimulator(root / "dp") as kubelet:
        fake.add_node({"metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE}},
                       "status": {"allocatable": {RESOURCE: "8"}, "capacity": {RESOURCE: "8"}}})
        kubeconfig = root / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": fake.url}}],
            "users": [{"name": "u", "user": {}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}],
        }))
        env = dict(os.environ, KUBECONFIG=str(kubeconfig), NODE_NAME=NODE)
        proc = subprocess.Popen(
            [sys.executable, "-m", "gpuplugin.cli", "run", "--device-plugin-dir", str(root / "dp"),
             "--topology", str(DGX1), "--pod-resources-socket", str(root / "podres.sock"), "--metrics-port", "0",
             "--device-id-strategy", "index"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        try:
            yield {"fake": fake, "podres": podres, "kubelet": kubelet, "proc": proc}
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            shutil.rmtree(root, ignore_errors=True)


def test_publishes_topology_and_state_and_honours_a_plan(node_env: dict) -> None:
    fake, podres, kubelet, proc = node_env["fake"], node_env["podres"], node_env["kubelet"], node_env["proc"]
    devices = kubelet.wait_for_devices(RESOURCE, 8, timeout=30)
    ids = [d.id for d in devices]
    assert ids == [str(i) for i in range(8)]

    def annotations() -> dict:
        return (fake.node(NODE) or {}).get("metadata", {}).get("annotations", {})

    assert _wait(lambda: "gpu-topology.io/topology" in annotations()), proc.poll()
    topo = topology_from_json(annotations()["gpu-topology.io/topology"])
    assert topo.ids == tuple(ids) and topo.fabric == "nvlink"
    labels = fake.node(NODE)["metadata"]["labels"]
    assert labels["gpu-topology.io/fabric"] == "nvlink" and labels["gpu-topology.io/gpu-count"] == "8"

    # The extender bound a pod here with a plan that is not the plugin's own first choice for 2 GPUs (0,3).
    plan = {"v": 1, "node": NODE, "resource": RESOURCE, "containers": {"main": ["4", "7"]}, "gbps": 40.0}
    fake.add_pod({
        "metadata": {"name": "trainer", "namespace": "default",
                     "annotations": {"gpu-topology.io/plan": json.dumps(plan)}},
        "spec": {"nodeName": NODE, "containers": [{"name": "main", "image": "x",
                                                    "resources": {"limits": {RESOURCE: "2"}}}]},
        "status": {"phase": "Pending"},
    })
    assert _wait(lambda: kubelet.preferred_raw(RESOURCE, ids, [], 2) == ["4", "7"])
    kubelet.allocate(RESOURCE, ["4", "7"])

    # The kubelet now reports them allocated: the state annotation follows PodResources.
    podres.service.set_pod("default", "trainer", {"main": {RESOURCE: ["4", "7"]}})
    assert _wait(lambda: state_from_json(annotations().get("gpu-topology.io/state", '{"v":1}')).used
                 == frozenset({"4", "7"}), timeout=30)
    # A plan that is no longer inside the available set is not handed out: the plugin's own best instead.
    rest = [x for x in ids if x not in ("4", "7")]
    assert kubelet.preferred_raw(RESOURCE, rest, [], 2) == ["0", "3"]
