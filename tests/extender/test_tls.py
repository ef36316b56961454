"""`gpu-extender serve` and who may talk to it: HTTPS with a certificate and key, client certificates required with
--tls-client-ca (kube-scheduler's tlsConfig), plain HTTP on loopback, and plain HTTP on any other address refused
unless explicitly allowed. The metrics listener serves health and metrics only.

Certificates are made per test session by the `cryptography` package; where it is not installed, by the openssl
command with the same profile (a CA, a server certificate for 127.0.0.1, a client certificate, and a foreign CA
with its own client).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import ssl
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from extender.cli import is_loopback
from sim.ports import free_port
from tests.extender.conftest import DGX1
from tests.helpers.paths import short_dir
from tests.helpers.polling import eventually
from tests.helpers.processes import accepts, stop_process, wait_serving
from tests.helpers.scheduler import cache_args, pod_json

GPU_EXTENDER = Path(sys.executable).parent / "gpu-extender"
WAIT = 30.0  # liveness bound for a starting process on a loaded machine, not a performance figure

try:  # the openssl fallback runs where cryptography is not installed
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
except ImportError:
    x509 = None  # type: ignore[assignment]

if x509 is None and shutil.which("openssl") is None:
    pytest.skip("needs the cryptography package or the openssl command to make certificates",
                allow_module_level=True)


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    foreign_client_cert: Path
    foreign_client_key: Path


# ---------------------------------------------------------------------------------------------------------------
# certificates


def _issue_with_cryptography(directory: Path, name: str, issuer: tuple[object, object] | None, *,
                             usage: str) -> tuple[object, object]:
    """A P-256 key and certificate `name`.crt/.key; usage "ca", "server" (127.0.0.1, localhost) or "client"."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    issuer_cert, issuer_key = issuer if issuer is not None else (None, key)
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(subject)
               .issuer_name(issuer_cert.subject if issuer_cert is not None else subject)  # type: ignore[attr-defined]
               .public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                   issuer_key.public_key()), critical=False))  # type: ignore[attr-defined]
    if usage == "ca":
        builder = (builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
                   .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                                content_commitment=False, key_encipherment=False,
                                                data_encipherment=False, key_agreement=False, encipher_only=False,
                                                decipher_only=False), critical=True))
    else:
        builder = builder.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        eku = ExtendedKeyUsageOID.SERVER_AUTH if usage == "server" else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([eku]), critical=False)
    if usage == "server":
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
    cert = builder.sign(issuer_key, hashes.SHA256())  # type: ignore[arg-type]
    (directory / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{name}.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert, key


_OPENSSL_EXT = {
    "ca": "basicConstraints=critical,CA:TRUE,pathlen:0\nkeyUsage=critical,keyCertSign,cRLSign,digitalSignature\n",
    "server": "basicConstraints=critical,CA:FALSE\nextendedKeyUsage=serverAuth\n"
              "subjectAltName=IP:127.0.0.1,DNS:localhost\n",
    "client": "basicConstraints=critical,CA:FALSE\nextendedKeyUsage=clientAuth\n",
}


def _issue_with_openssl(directory: Path, name: str, issuer: str | None, *, usage: str) -> str:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60)

    (directory / f"{name}.ext").write_text(_OPENSSL_EXT[usage] + "subjectKeyIdentifier=hash\n"
                                           "authorityKeyIdentifier=keyid\n")
    run("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", f"{name}.key",
        "-out", f"{name}.csr", "-subj", f"/CN={name}")
    signer = ["-signkey", f"{name}.key"] if issuer is None else ["-CA", f"{issuer}.crt", "-CAkey", f"{issuer}.key",
                                                                   "-CAcreateserial"]
    run("x509", "-req", "-in", f"{name}.csr", *signer, "-days", "1", "-sha256", "-extfile", f"{name}.ext",
        "-out", f"{name}.crt")
    return name


def make_pki(directory: Path) -> Pki:
    if x509 is not None:
        ca = _issue_with_cryptography(directory, "ca", None, usage="ca")
        _issue_with_cryptography(directory, "server", ca, usage="server")
        _issue_with_cryptography(directory, "client", ca, usage="client")
        foreign = _issue_with_cryptography(directory, "foreign-ca", None, usage="ca")
        _issue_with_cryptography(directory, "foreign-client", foreign, usage="client")
    else:
        _issue_with_openssl(directory, "ca", None, usage="ca")
        _issue_with_openssl(directory, "server", "ca", usage="server")
        _issue_with_openssl(directory, "client", "ca", usage="client")
        _issue_with_openssl(directory, "foreign-ca", None, usage="ca")
        _issue_with_openssl(directory, "foreign-client", "foreign-ca", usage="client")
    d = directory
    return Pki(d / "ca.crt", d / "server.crt", d / "server.key", d / "client.crt", d / "client.key",
               d / "foreign-client.crt", d / "foreign-client.key")


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    with short_dir("tls-") as path:
        (path / "inventory.yaml").write_text(yaml.safe_dump({"nodes": [{"name": "n1", "topology": str(DGX1)}]}))
        yield path


@pytest.fixture(scope="module")
def pki(workdir: Path) -> Pki:
    (workdir / "pki").mkdir()
    return make_pki(workdir / "pki")


# ---------------------------------------------------------------------------------------------------------------
# the process



@contextmanager
def serving(workdir: Path, *args: str, env: dict[str, str] | None = None,
            wait_port: str = "port") -> Iterator[dict[str, int]]:
    """`gpu-extender serve` standalone on free ports ({"port", "metrics_port"}); stopped on exit."""
    ports = {"port": free_port(), "metrics_port": free_port()}
    command = [str(GPU_EXTENDER), "serve", "--inventory", str(workdir / "inventory.yaml"),
               "--port", str(ports["port"]), *args]
    command = [a.replace("{metrics_port}", str(ports["metrics_port"])) for a in command]
    with open(workdir / "serve.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})})
    try:
        wait_serving(process, lambda: accepts(ports[wait_port]), WAIT, workdir / "serve.log")
        yield ports
    finally:
        stop_process(process)


def _refused(workdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(GPU_EXTENDER), "serve", "--inventory", str(workdir / "inventory.yaml"),
                           "--port", str(free_port()), *args], capture_output=True, text=True, timeout=60)


def _client_context(pki: Pki, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca))
    if cert is not None and key is not None:
        context.load_cert_chain(str(cert), str(key))
    return context


def _filter(client: httpx.Client) -> httpx.Response:
    return client.post("/filter", json=cache_args(pod_json("p", 2), ["n1"]))


# ---------------------------------------------------------------------------------------------------------------
# tests


def test_https_with_certificate_and_key_serves_the_api(workdir: Path, pki: Pki) -> None:
    with serving(workdir, "--host", "127.0.0.1", "--tls-cert", str(pki.server_cert),
                 "--tls-key", str(pki.server_key)) as ports:
        url = f"https://127.0.0.1:{ports['port']}"
        with httpx.Client(base_url=url, verify=_client_context(pki), timeout=30) as client:
            assert client.get("/healthz").text == "ok"
            assert _filter(client).json()["NodeNames"] == ["n1"]
        # The port speaks TLS only: a plain HTTP request gets no HTTP answer.
        with httpx.Client(base_url=f"http://127.0.0.1:{ports['port']}", timeout=30) as plain, \
                pytest.raises(httpx.TransportError):
            plain.get("/healthz")
        # A client that does not trust the serving CA refuses the server.
        with httpx.Client(base_url=url, timeout=30) as stranger, pytest.raises(httpx.ConnectError):
            stranger.get("/healthz")


def _client_ca_admits_only_clients_with_a_certificate_it_signed(pki: Pki, port: int) -> None:
    url = f"https://127.0.0.1:{port}"
    signed = _client_context(pki, pki.client_cert, pki.client_key)
    with httpx.Client(base_url=url, verify=signed, timeout=30) as client:
        assert client.get("/healthz").status_code == 200
        assert _filter(client).json()["NodeNames"] == ["n1"]
    for context in (_client_context(pki), _client_context(pki, pki.foreign_client_cert, pki.foreign_client_key)):
        # TLS 1.3: the server's verdict on the client certificate arrives after the client's handshake ends,
        # so the refusal shows as a failed handshake or a connection closed before any answer.
        with httpx.Client(base_url=url, verify=context, timeout=30) as client, \
                pytest.raises(httpx.TransportError):
            client.get("/healthz")


def test_plain_http_on_loopback_is_served(workdir: Path) -> None:
    with serving(workdir, "--host", "127.0.0.1") as ports, \
            httpx.Client(base_url=f"http://127.0.0.1:{ports['port']}", timeout=30) as client:
        assert client.get("/healthz").text == "ok"
        assert _filter(client).json()["NodeNames"] == ["n1"]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "gpu-extender.example"])
def test_plain_http_off_loopback_is_refused_with_the_way_out_named(workdir: Path, host: str) -> None:
    result = _refused(workdir, "--host", host)
    assert result.returncode == 2
    assert f"refusing to serve plain HTTP on {host!r}" in result.stderr
    for way_out in ("--tls-cert", "127.0.0.1", "--allow-insecure-remote", "GPU_EXTENDER_ALLOW_INSECURE_REMOTE"):
        assert way_out in result.stderr


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_plain_http_off_loopback_is_served_when_explicitly_allowed(workdir: Path, how: str) -> None:
    args = ["--host", "0.0.0.0"] + (["--allow-insecure-remote"] if how == "flag" else [])
    env = {"GPU_EXTENDER_ALLOW_INSECURE_REMOTE": "1"} if how == "environment" else None
    with serving(workdir, *args, env=env) as ports, \
            httpx.Client(base_url=f"http://127.0.0.1:{ports['port']}", timeout=30) as client:
        assert client.get("/healthz").text == "ok"
    assert '"event": "extender.server.insecure_remote"' in (workdir / "serve.log").read_text()


def test_https_off_loopback_needs_no_override(workdir: Path, pki: Pki) -> None:
    with serving(workdir, "--host", "0.0.0.0", "--tls-cert", str(pki.server_cert),
                 "--tls-key", str(pki.server_key)) as ports, \
            httpx.Client(base_url=f"https://127.0.0.1:{ports['port']}", verify=_client_context(pki),
                         timeout=30) as client:
        assert client.get("/healthz").text == "ok"


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LOCALHOST.", True), ("0.0.0.0", False), ("::", False), ("", False), ("10.0.0.7", False),
    ("localhost.example", False), ("my-host", False),
])
def test_loopback_means_unreachable_from_other_machines(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_client_ca_admits_only_signed_clients_and_the_metrics_listener_serves_health_and_metrics_only(
        workdir: Path, pki: Pki) -> None:
    """A sidecar's API on loopback over TLS with --tls-client-ca (kube-scheduler's tlsConfig): only clients with a
    certificate the CA signed get through. Its metrics listener plain: scrapes and probes get through, the verbs
    and the OpenAPI document do not. One process for both (the API's port is checked once it accepts)."""
    with serving(workdir, "--host", "127.0.0.1", "--tls-cert", str(pki.server_cert), "--tls-key",
                 str(pki.server_key), "--tls-client-ca", str(pki.ca), "--metrics-host", "127.0.0.1",
                 "--metrics-port", "{metrics_port}", wait_port="metrics_port") as ports, \
            httpx.Client(base_url=f"http://127.0.0.1:{ports['metrics_port']}", timeout=30) as client:
        assert eventually(lambda: accepts(ports["port"]), WAIT)
        _client_ca_admits_only_clients_with_a_certificate_it_signed(pki, ports["port"])
        assert client.get("/healthz").text == "ok"
        assert client.get("/readyz").status_code == 200
        assert "gpu_extender_requests_total" in client.get("/metrics").text
        for path in ("/filter", "/prioritize", "/bind", "/preempt"):
            assert client.post(path, json={}).status_code == 404
        assert client.get("/openapi.json").status_code == 404
        assert client.get("/inventory").status_code == 404


def test_metrics_port_must_differ_from_the_api_port(workdir: Path) -> None:
    port = str(free_port())
    result = subprocess.run([str(GPU_EXTENDER), "serve", "--inventory", str(workdir / "inventory.yaml"),
                             "--port", port, "--metrics-port", port], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--metrics-port" in result.stderr
