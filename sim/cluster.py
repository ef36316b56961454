"""A local cluster of simulated GPU nodes: real plugin processes, kubelet simulators, and the real extender.

Each node is a directory with a kubelet simulator serving kubelet.sock and a real `gpuplugin run --topology FILE`
process registered to it over a real unix socket. The extender is a real `gpu-extender serve --inventory` process
on uvicorn (standalone mode, 127.0.0.1). Everything started here is stopped, and every socket and file removed, on
exit, also after an error or Ctrl-C.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from gputopo.core import Topology
from gputopo.discovery.loader import load_topology_file
from sim.kubelet import KubeletSimulator
from sim.ports import free_port

RESOURCE = "nvidia.com/gpu"


class ClusterError(RuntimeError):
    """A process of the local cluster did not come up; the message carries the tail of its log."""


@dataclass
class SimNode:
    name: str
    topology_file: Path
    topology: Topology
    plugin_dir: Path
    kubelet: KubeletSimulator
    process: subprocess.Popen[bytes] | None = None
    allocated: set[str] = field(default_factory=set)
    log_path: Path | None = None

    def free_ids(self) -> list[str]:
        healthy = [d.id for d in self.kubelet.devices(RESOURCE) if d.healthy]
        return [x for x in healthy if x not in self.allocated]



def _tail(path: Path | None, lines: int = 15) -> str:
    if path is None or not path.exists():
        return ""
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class LocalCluster:
    """`with LocalCluster([("dgx1-a", path), ...]) as cluster:` then cluster.nodes and cluster.extender_url."""

    def __init__(self, nodes: Sequence[tuple[str, Path]], *, timeout_s: float = 30.0) -> None:
        self._spec = list(nodes)
        self.timeout_s = timeout_s
        # under TMPDIR (default /tmp), so runs side by side keep apart and a caller can check what one leaves;
        # unix socket paths under it must stay within 108 bytes, which a short TMPDIR leaves room for
        self.workdir = Path(tempfile.mkdtemp(prefix="gpu-demo-"))
        self.nodes: dict[str, SimNode] = {}
        self.extender: subprocess.Popen[bytes] | None = None
        self.extender_url = ""
        self._extender_log: Path | None = None
        self._env = dict(os.environ, PYTHONUNBUFFERED="1")

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        for name, path in self._spec:
            plugin_dir = self.workdir / name
            kubelet = KubeletSimulator(plugin_dir).start()
            log_path = self.workdir / f"{name}.log"
            node = SimNode(name, path, load_topology_file(path), plugin_dir, kubelet, log_path=log_path)
            self.nodes[name] = node
            with open(log_path, "wb") as log:
                node.process = subprocess.Popen(
                    [sys.executable, "-m", "gpuplugin.cli", "run", "--device-plugin-dir", str(plugin_dir),
                     "--topology", str(path), "--metrics-port", "0", "--no-publish", "--log-level", "warning"],
                    stdout=log, stderr=subprocess.STDOUT, env=self._env,
                )
        self._start_extender()
        for node in self.nodes.values():
            try:
                node.kubelet.wait_for_devices(RESOURCE, node.topology.size, timeout=self.timeout_s)
            except TimeoutError:
                raise ClusterError(f"plugin of {node.name} did not register:\n{_tail(node.log_path)}") from None

    def _start_extender(self) -> None:
        inventory = self.workdir / "inventory.yaml"
        inventory.write_text(
            yaml.safe_dump({"nodes": [{"name": n.name, "topology": str(n.topology_file)} for n in self.nodes.values()]})
        )
        port = free_port()
        self._extender_log = self.workdir / "extender.log"
        with open(self._extender_log, "wb") as log:
            self.extender = subprocess.Popen(
                [sys.executable, "-m", "extender.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                 "--inventory", str(inventory), "--log-level", "warning"],
                stdout=log, stderr=subprocess.STDOUT, env=self._env,
            )
        self.extender_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.extender.poll() is not None:
                break
            try:
                if httpx.get(f"{self.extender_url}/readyz", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise ClusterError(f"extender did not become ready:\n{_tail(self._extender_log)}")

    def stop(self) -> None:
        procs = [n.process for n in self.nodes.values() if n.process] + ([self.extender] if self.extender else [])
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for node in self.nodes.values():
            node.kubelet.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """Processes still alive and paths still present: empty after a clean stop."""
        alive = [f"pid {p.pid}" for p in [n.process for n in self.nodes.values()] + [self.extender]
                 if p is not None and p.poll() is None]
        return alive + ([str(self.workdir)] if self.workdir.exists() else [])
