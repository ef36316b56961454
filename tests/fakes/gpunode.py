"""A GPU node for tests, as the plugin sees one in a cluster: `gpuplugin run` as a process with a kubeconfig that
points at the in-process kube-apiserver, NODE_NAME set, the kubelet simulator, and the kubelet's PodResources socket.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sim.kubelet import KubeletSimulator
from tests.fakes.kubeapi import FakeKubeApi
from tests.fakes.kubelet_podresources import PodResourcesServer
from tests.helpers.kube import k8s_node, write_kubeconfig
from tests.helpers.paths import short_dir
from tests.helpers.processes import stop_process


@dataclass
class GpuNode:
    name: str
    fake: FakeKubeApi
    podres: PodResourcesServer
    kubelet: KubeletSimulator
    process: subprocess.Popen[bytes]
    log: Path
    argv: tuple[str, ...] = ()
    env: dict[str, str] | None = None

    def stop(self) -> None:
        stop_process(self.process, log=self.log)

    def kill(self) -> None:
        """SIGKILL: the plugin's container ended without a word (an OOM kill, a node agent crash)."""
        self.process.kill()
        self.process.wait(10)

    def start_again(self) -> None:
        """A new plugin process with the same arguments (the DaemonSet's next pod), its output appended."""
        with open(self.log, "ab") as out:
            self.process = subprocess.Popen(list(self.argv), env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def admitting(self, pod: str, namespace: str = "default") -> None:
        """What the kubelet does before it asks for a pod's devices: list the pod in PodResources, holding none."""
        self.podres.service.set_pod(namespace, pod, {"main": {}})

    def log_tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


@contextmanager
def gpu_node(name: str, topology: Path | None, *, args: Sequence[str] = (),
             nvml_recording: Path | None = None) -> Iterator[GpuNode]:
    """`topology`: the plugin's --topology file; or None and `nvml_recording`, replayed as NVML (MIG, health)."""
    source = ["--topology", str(topology)] if topology is not None else ["--nvml-recording", str(nvml_recording)]
    with short_dir("node-") as root, FakeKubeApi() as fake, \
            PodResourcesServer(str(root / "podres.sock")) as podres, KubeletSimulator(root / "dp") as kubelet:
        fake.add_node(k8s_node(name))
        kubeconfig = write_kubeconfig(root / "kubeconfig", fake.url)
        env = dict(os.environ, KUBECONFIG=str(kubeconfig), NODE_NAME=name)
        argv = (sys.executable, "-m", "gpuplugin.cli", "run", "--device-plugin-dir", str(root / "dp"),
                *source, "--pod-resources-socket", str(root / "podres.sock"),
                "--metrics-port", "0", *args)
        with open(root / "plugin.log", "wb") as out:
            process = subprocess.Popen(list(argv), env=env, stdout=out, stderr=subprocess.STDOUT)
        node = GpuNode(name, fake, podres, kubelet, process, root / "plugin.log", argv, env)
        try:
            yield node
        finally:
            node.stop()
