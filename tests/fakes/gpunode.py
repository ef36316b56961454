"""A GPU node for tests, as the plugin sees one in a cluster: `gpuplugin run` as a process with a kubeconfig that
points at the in-process kube-apiserver, NODE_NAME set, the kubelet simulator, and the kubelet's PodResources socket.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import yaml

from sim.kubelet import KubeletSimulator
from tests.fakes.kubeapi import FakeKubeApi
from tests.fakes.kubelet_podresources import PodResourcesServer

RESOURCE = "nvidia.com/gpu"


def write_kubeconfig(path: Path, server: str, token: str | None = None) -> Path:
    user = {"token": token} if token else {}
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "u"}}],
    }))
    return path


def terminate(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, as the kubelet does on pod deletion, then SIGKILL after 20 s; idempotent."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class GpuNode:
    name: str
    fake: FakeKubeApi
    podres: PodResourcesServer
    kubelet: KubeletSimulator
    process: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        terminate(self.process)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


@contextmanager
def gpu_node(name: str, topology: Path, *, args: Sequence[str] = ()) -> Iterator[GpuNode]:
    root = Path(tempfile.mkdtemp(prefix="node-", dir="/tmp"))  # unix socket paths must stay short
    try:
        with FakeKubeApi() as fake, PodResourcesServer(str(root / "podres.sock")) as podres, \
                KubeletSimulator(root / "dp") as kubelet:
            fake.add_node({"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
                           "status": {"allocatable": {RESOURCE: "8"}, "capacity": {RESOURCE: "8"}}})
            kubeconfig = write_kubeconfig(root / "kubeconfig", fake.url)
            env = dict(os.environ, KUBECONFIG=str(kubeconfig), NODE_NAME=name)
            with open(root / "plugin.log", "wb") as out:
                process = subprocess.Popen(
                    [sys.executable, "-m", "gpuplugin.cli", "run", "--device-plugin-dir", str(root / "dp"),
                     "--topology", str(topology), "--pod-resources-socket", str(root / "podres.sock"),
                     "--metrics-port", "0", *args],
                    env=env, stdout=out, stderr=subprocess.STDOUT,
                )
            node = GpuNode(name, fake, podres, kubelet, process, root / "plugin.log")
            try:
                yield node
            finally:
                node.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)
