"""The real Cluster Autoscaler 1.31.5 as a process beside a real control plane (tests/helpers/controlplane.py), its
cloud the project's own externalgrpc provider (sim.ca_provider) whose scale-ups are simulated GPU nodes started
the one way the real tier starts them (tests.helpers.realnode.real_gpu_node).

The binary comes from `shared/autoscaler/` beside the clone (GPU_TOPOLOGY_AUTOSCALER_DIR names another such
folder): `unpack.sh DIR` writes and checks it (1.5 s), once per test session into a temporary directory. Without
that folder (or the Kubernetes binaries, or etcd) the tier skips, naming why.

CA's flags compress its clock as shared/autoscaler/README.md gives them: a 5 s loop, scale-down after a node has
been unneeded for `unneeded`, no delays after adds or deletes, and unremovable nodes looked at again after 10 s
(the 5-minute default would outlast a test once a pod without a controller had held a node). Its log (--v=4) is
the verdict trail a failing test attaches."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from sim.ca_provider import NodeGroupSpec, ProviderServer, SimProvider
from sim.ports import free_ports
from tests.helpers import controlplane
from tests.helpers.chart_install import install_chart
from tests.helpers.controlplane import NODE_CAPACITY, ControlPlane, Proc, start_process, tidied, wait_until
from tests.helpers.paths import REPO
from tests.helpers.realnode import real_gpu_node

AUTOSCALER_SHARED = Path(os.environ.get("GPU_TOPOLOGY_AUTOSCALER_DIR") or REPO.parent / "shared" / "autoscaler")


def skip_reason() -> str | None:
    """Why the real-autoscaler tier cannot run here (one line for pytest.skip), or None."""
    if (why := controlplane.skip_reason()) is not None:
        return why
    if not all((AUTOSCALER_SHARED / f).is_file() for f in ("cluster-autoscaler.xz", "SHA256SUMS", "unpack.sh")):
        return f"no Cluster Autoscaler at {AUTOSCALER_SHARED} (the shared directory beside the clone)"
    return None


def unpack(dest: Path) -> Path:
    """The cluster-autoscaler binary, unpacked and checked by its unpack.sh into `dest`."""
    done = subprocess.run(["bash", str(AUTOSCALER_SHARED / "unpack.sh"), str(dest)], capture_output=True, text=True,
                          timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"unpacking {AUTOSCALER_SHARED} failed: {done.stderr.strip()[-500:]}")
    return dest / "cluster-autoscaler"


@contextlib.contextmanager
def product_for_ca(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                   namespace: str) -> Iterator[tuple[ControlPlane, Path]]:
    """What every real-CA module starts from: the shared real control plane (tidied after), `namespace`, the product
    installed as the chart deploys it, and the CA binary. Skips, naming why, without shared/autoscaler, shared/kube
    or etcd."""
    if (why := skip_reason()) is not None:
        pytest.skip(why)
    binary = unpack(tmp_path_factory.mktemp("cluster-autoscaler"))
    real_control_plane: ControlPlane = request.getfixturevalue("real_control_plane")
    with tidied(real_control_plane) as cp:
        cp.ensure_namespace(namespace)
        install_chart(cp)
        yield cp, binary


@dataclass
class Autoscaler:
    """A running CA and its cloud: the provider (what it was asked, which nodes it runs) and the process."""

    proc: Proc
    provider: SimProvider

    @property
    def cp(self) -> ControlPlane:
        """The control plane the provider creates its Nodes in."""
        return self.provider.kube  # type: ignore[return-value]

    def log_tail(self, chars: int = 6000) -> str:
        return self.proc.log_tail(chars)

    def log(self) -> str:
        return self.proc.log.read_text(errors="replace")

    def wait(self, what: str, check: object, timeout: float) -> None:
        """wait_until, with CA's log tail (its verdicts) and the provider's errors in the failure message."""
        try:
            wait_until(what, check, timeout, self.proc)  # type: ignore[arg-type]
        except RuntimeError as e:
            raise AssertionError(f"{e}\nprovider errors: {self.provider.errors}\nCA log tail:\n{self.log_tail()}") \
                from None


@contextlib.contextmanager
def running_autoscaler(cp: ControlPlane, binary: Path, groups: Sequence[NodeGroupSpec], *,
                       expander: str = "least-waste", unneeded: str = "15s", extra: Sequence[str] = (),
                       plugin_args: Mapping[str, Sequence[str]] | None = None, publish_delay_s: float = 0.0,
                       registration_labels: bool = True) -> Iterator[Autoscaler]:
    """The provider serving `groups` and CA pointed at it with the admin kubeconfig; CA is up once its
    /health-check answers 200 (its first loop ran). On exit CA stops first, then every node the provider started.
    A new node's plugin starts `publish_delay_s` after its Node registered (Ready, no GPUs yet); with
    `registration_labels=False` the Node registers without the template's labels (the GPU label and the plugin's),
    as a kubelet without `--node-labels` would, and carries the plugin's only once it publishes them."""

    @contextlib.contextmanager
    def start_node(name: str, group: NodeGroupSpec, labels: Mapping[str, str]) -> Iterator[object]:
        # the labels a node group's kubelet registers with (`gpuplugin node-template --format kubelet`)
        with real_gpu_node(cp, name, topology=group.topology, labels=labels if registration_labels else None,
                           args=(*group.plugin_args(), *(plugin_args or {}).get(group.id, ())),
                           publish_delay_s=publish_delay_s) as node:
            yield node

    grpc_port, metrics_port = free_ports(2)
    provider = SimProvider(cp, groups, start_node, node_resources=NODE_CAPACITY)
    # one log per CA: the modules of the real tier share one control plane (and its directory) in turn
    log_path = cp.dir / f"cluster-autoscaler-{grpc_port}.log"
    config = cp.dir / f"ca-cloud-config-{grpc_port}.yaml"
    config.write_text(f"address: 127.0.0.1:{grpc_port}\n")
    with ProviderServer(provider, grpc_port):
        proc = start_process("cluster-autoscaler", [
            str(binary), "--cloud-provider=externalgrpc", f"--cloud-config={config}", f"--kubeconfig={cp.kubeconfig}",
            f"--address=127.0.0.1:{metrics_port}", f"--expander={expander}", "--scan-interval=5s",
            f"--scale-down-unneeded-time={unneeded}", "--scale-down-delay-after-add=0s",
            "--scale-down-delay-after-delete=0s", "--scale-down-delay-after-failure=0s",
            "--unremovable-node-recheck-timeout=10s", "--skip-nodes-with-local-storage=false",
            "--skip-nodes-with-system-pods=false", "--leader-elect=false", "--v=4", *extra,
        ], log_path)
        ca = Autoscaler(proc, provider)
        try:
            ca.wait("CA's /health-check", lambda: httpx.get(f"http://127.0.0.1:{metrics_port}/health-check",
                                                            timeout=2).status_code == 200, 60)
            yield ca
        finally:
            proc.stop()
            if (keep := os.environ.get("GPU_TOPOLOGY_KEEP_CA_LOG")) and log_path.is_file():
                shutil.copy(log_path, keep)
