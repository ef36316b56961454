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

    def stop(self) -> None:
        stop_process(self.process)

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
        with open(root / "plugin.log", "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "gpuplugin.cli", "run", "--device-plugin-dir", str(root / "dp"),
                 *source, "--pod-resources-socket", str(root / "podres.sock"),
                 "--metrics-port", "0", *args],
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )
        node = GpuNode(name, fake, podres, kubelet, process, root / "plugin.log")
        try:
            yield node
        finally:
            node.stop()
