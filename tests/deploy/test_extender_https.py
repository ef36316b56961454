"""The default-scheduler variant end to end on loopback: certificates from deploy/scheduler/make-extender-certs.sh,
laid out as the gpu-extender-tls Secret is mounted, serve the real extender with the Deployment's arguments;
a client configured like the kube-scheduler snippet (CA, client certificate, serverName) gets through, and
clients without a certificate or with a foreign one do not."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.rendering import ROOT, SCHEDULER_DIR, containers, find, kustomize_build
from tests.helpers.paths import short_dir
from tests.helpers.processes import accepts, stop_process, wait_serving

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
CERT_SCRIPT = SCHEDULER_DIR / "make-extender-certs.sh"
WAIT = 30.0  # liveness bound for the process to start on a loaded machine, never a performance figure


def _certs(directory: Path, namespace: str = "gpu-topology") -> Path:
    subprocess.run(["bash", str(CERT_SCRIPT), str(directory), namespace], check=True, capture_output=True,
                   timeout=60)
    return directory


def _deployment() -> tuple[dict[str, Any], dict[str, Any]]:
    (deployment,) = find(kustomize_build(SCHEDULER_DIR), "Deployment")
    ((pod, container),) = list(containers(deployment))
    return pod, container


@pytest.fixture(scope="module")
def https_extender() -> Iterator[dict[str, Any]]:
    with short_dir("https-") as tmp:
        certs = _certs(tmp / "certs")
        pod, container = _deployment()
        (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
        assert volume["secret"]["secretName"] == "gpu-extender-tls"
        # The Secret's keys become files under the mount path.
        mounted = tmp / mount["mountPath"].lstrip("/")
        mounted.mkdir(parents=True)
        for key in ("tls.crt", "tls.key", "ca.crt"):
            shutil.copyfile(certs / key, mounted / key)
        inventory = tmp / "inventory.yaml"
        topology = ROOT / "gputopo" / "data" / "dgx1-v100-hybrid-cube-mesh.txt"
        inventory.write_text(yaml.safe_dump({"nodes": [{"name": "gpu-node-1", "topology": str(topology)}]}))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        args = []
        for arg in container["args"][1:]:
            key, _, value = arg.partition("=")
            if key.startswith("--leader-elect"):
                continue  # it serves an inventory here, with no apiserver to hold a Lease on
            if key == "--metrics-port":
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    value = str(s.getsockname()[1])
            if value.startswith(mount["mountPath"]):
                value = str(tmp / value.lstrip("/"))
            elif key == "--host":
                value = "127.0.0.1"  # the pod's 0.0.0.0, narrowed for the test machine
            elif key == "--port":
                value = str(port)
            args.append(f"{key}={value}" if value else key)  # a flag without a value: a switch
        process = subprocess.Popen([str(Path(sys.executable).parent / "gpu-extender"), "serve", *args,
                                    "--inventory", str(inventory)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_serving(process, lambda: accepts(port), WAIT)
            yield {"port": port, "certs": certs, "tmp": tmp}
        finally:
            stop_process(process, 10)


def _get(port: int, context: ssl.SSLContext, server_name: str, path: str = "/healthz") -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
            context.wrap_socket(raw, server_hostname=server_name) as tls:
        tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {server_name}\r\nConnection: close\r\n\r\n".encode())
        chunks = []
        while chunk := tls.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def _refused(port: int, context: ssl.SSLContext, server_name: str) -> bool:
    """No HTTP answer: the handshake fails, or (TLS 1.3) the server drops the connection after it."""
    try:
        return not _get(port, context, server_name).startswith("HTTP/")
    except (ssl.SSLError, ConnectionError):
        return True


def _scheduler_tls() -> dict[str, Any]:
    config = yaml.safe_load((SCHEDULER_DIR / "default-scheduler-extender.yaml").read_text())
    return config["extenders"][0]["tlsConfig"]


def _client(certs: Path, with_certificate: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    if with_certificate:
        context.load_cert_chain(str(certs / "client.crt"), str(certs / "client.key"))
    return context


def test_scheduler_configured_client_is_served(https_extender: dict[str, Any]) -> None:
    tls = _scheduler_tls()
    assert {Path(tls[k]).name for k in ("caFile", "certFile", "keyFile")} == {"ca.crt", "client.crt", "client.key"}
    answer = _get(https_extender["port"], _client(https_extender["certs"]), tls["serverName"])
    assert answer.startswith("HTTP/1.1 200")
    metrics = _get(https_extender["port"], _client(https_extender["certs"]), tls["serverName"], "/metrics")
    assert "gpu_extender_requests_total" in metrics


def test_client_without_certificate_is_refused(https_extender: dict[str, Any]) -> None:
    assert _refused(https_extender["port"], _client(https_extender["certs"], with_certificate=False),
                    _scheduler_tls()["serverName"])


def test_client_certificate_from_another_ca_is_refused(https_extender: dict[str, Any]) -> None:
    foreign = _certs(https_extender["tmp"] / "foreign")
    context = ssl.create_default_context(cafile=str(https_extender["certs"] / "ca.crt"))
    context.load_cert_chain(str(foreign / "client.crt"), str(foreign / "client.key"))
    assert _refused(https_extender["port"], context, _scheduler_tls()["serverName"])


def test_wrong_server_name_is_rejected_by_the_client(https_extender: dict[str, Any]) -> None:
    with pytest.raises(ssl.SSLCertVerificationError):
        _get(https_extender["port"], _client(https_extender["certs"]), "gpu-extender.other-namespace.svc")
