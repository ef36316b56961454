"""`gpu-extender serve` as a real process: standalone inventory, HTTPS with client certificates; clear errors."""

from __future__ import annotations

import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner

from extender.cli import main
from sim.ports import free_port
from tests.extender.conftest import A100, write_inventory
from tests.helpers.paths import REPO
from tests.helpers.processes import http_ok, stop_process, wait_serving
from tests.helpers.scheduler import cache_args, pod_json


def _openssl_cert(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.pem", directory / f"{name}-key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", f"/CN={name}", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    return cert, key



@pytest.mark.skipif(not Path("/usr/bin/openssl").exists(), reason="needs the openssl command")
def test_serve_over_mutual_tls(tmp_path: Path) -> None:
    server_cert, server_key = _openssl_cert(tmp_path, "server")
    client_cert, client_key = _openssl_cert(tmp_path, "client")
    inv = write_inventory(tmp_path / "inv.yaml", [{"name": "a100", "topology": A100}])
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "extender.cli", "serve", "--inventory", str(inv), "--port", str(port),
         "--tls-cert", str(server_cert), "--tls-key", str(server_key), "--tls-client-ca", str(client_cert),
         "--log-level", "info"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    trusted = ssl.create_default_context(cafile=str(server_cert))
    trusted.load_cert_chain(str(client_cert), str(client_key))
    anonymous = ssl.create_default_context(cafile=str(server_cert))
    url = f"https://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, verify=trusted, timeout=5) as client:
            wait_serving(proc, lambda: http_ok("/healthz", client), 30)
            out = client.post("/filter", json=cache_args(pod_json(gpus=4), ["a100"])).json()
            assert out["NodeNames"] == ["a100"]
        with httpx.Client(base_url=url, verify=anonymous, timeout=5) as client, pytest.raises(httpx.TransportError):
            client.get("/healthz")
    finally:
        output, _ = stop_process(proc, 15)
    # graceful shutdown ran (uvicorn then re-raises SIGTERM, so the status is 0 or -SIGTERM)
    assert "extender.service.stopped" in output.decode() and proc.returncode in (0, -15)


def test_bad_inventory_is_a_clear_error(tmp_path: Path) -> None:
    inv = tmp_path / "inv.yaml"
    inv.write_text("nodes:\n  - name: a\n    topology: missing.txt\n")
    result = CliRunner().invoke(main, ["serve", "--inventory", str(inv)])
    assert result.exit_code == 1
    assert "node a" in result.output and "missing.txt" in result.output and "cannot read" in result.output
    inv.write_text("nodes:\n  - name: a\n    topolgy: x.txt\n")
    result = CliRunner().invoke(main, ["serve", "--inventory", str(inv)])
    assert result.exit_code == 1 and "unknown keys ['topolgy']" in result.output


def test_tls_flags_go_together(tmp_path: Path) -> None:
    cert, _ = _openssl_cert(tmp_path, "server") if Path("/usr/bin/openssl").exists() else (tmp_path / "c", None)
    cert.touch()
    inv = write_inventory(tmp_path / "inv.yaml", [{"name": "a100", "topology": A100}])
    result = CliRunner().invoke(main, ["serve", "--inventory", str(inv), "--tls-cert", str(cert)])
    assert result.exit_code == 2 and "--tls-cert and --tls-key go together" in result.output
