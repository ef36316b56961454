"""`gpu-extender webhook` as a real process over real HTTPS, called the way kube-apiserver v1.36 called the
recording webhook: the exact request bytes and headers (`POST /mutate?timeout=5s`), the CA as the caBundle. Then
what a hostile or broken client gets: a clear 4xx for what is not a review, 200 allowed with no patch for what is
not managed, closed connections past the read deadlines, nothing on plain HTTP; and a renewed certificate served
without a restart.

What the API server does when the webhook is down or hangs (fail open under failurePolicy Ignore, after waiting
the whole timeoutSeconds) is recorded in fixtures/recordings/kube-apiserver-admission/; the configuration that
relies on it is tested in tests/deploy/test_webhook_deploy.py.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from sim.ports import free_port
from tests.extender.webhook.pki import Pair, make_pair
from tests.extender.webhook.recordings import (
    PATCH,
    REQUEST_RAW,
    RESPONSE,
    decoded_patch,
    request_headers,
    request_path,
    review,
)

GPU_EXTENDER = Path(sys.executable).parent / "gpu-extender"
WAIT = 30.0  # liveness bound for a process or a reload on a loaded machine, not a performance figure
LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="webhook-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def pair(workdir: Path) -> Pair:
    return make_pair(workdir, "a")


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


@contextmanager
def webhook(workdir: Path, pair: Pair, *args: str) -> Iterator[dict[str, int]]:
    """The webhook on 127.0.0.1 on free ports ({"port", "metrics_port"}); stopped on exit."""
    ports = {"port": free_port(), "metrics_port": free_port()}
    logfile = workdir / f"webhook-{ports['port']}.log"
    command = [str(GPU_EXTENDER), "webhook", "--host", "127.0.0.1", "--port", str(ports["port"]),
               "--metrics-host", "127.0.0.1", "--metrics-port", str(ports["metrics_port"]),
               "--tls-cert", str(pair.cert), "--tls-key", str(pair.key), "--max-body-bytes", str(LIMIT), *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_EXTENDER_")}
    with open(logfile, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + WAIT
        while not (_accepts(ports["port"]) and _accepts(ports["metrics_port"])):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the webhook did not serve: {logfile.read_text()[-3000:]}")
            time.sleep(0.05)
        yield ports
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def served(workdir: Path, pair: Pair) -> Iterator[dict[str, int]]:
    with webhook(workdir, pair, "--header-timeout", "1", "--body-timeout", "1") as ports:
        yield ports


def _client(pair: Pair, port: int) -> httpx.Client:
    return httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=ssl.create_default_context(cafile=str(pair.ca)),
                        timeout=10)


def _post(pair: Pair, port: int, body: bytes, **headers: str) -> httpx.Response:
    with _client(pair, port) as client:
        return client.post(request_path(), content=body, headers={**request_headers(), **headers})


def test_the_api_servers_exact_request_gets_the_recorded_answer(served: dict[str, int], pair: Pair) -> None:
    answer = _post(pair, served["port"], REQUEST_RAW)
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
    body = answer.json()
    assert {k: v for k, v in body.items() if k != "response"} == {k: v for k, v in RESPONSE.items()
                                                                  if k != "response"}
    assert {k: v for k, v in body["response"].items() if k != "patch"} == {
        k: v for k, v in RESPONSE["response"].items() if k != "patch"}
    assert decoded_patch(body) == PATCH


def test_a_pod_it_does_not_manage_is_allowed_with_no_patch(served: dict[str, int], pair: Pair) -> None:
    data = review(lambda r: r["object"]["spec"]["containers"][0].pop("resources"))
    answer = _post(pair, served["port"], json.dumps(data).encode())
    assert answer.status_code == 200
    assert answer.json()["response"] == {"uid": data["request"]["uid"], "allowed": True}


def test_an_unreadable_pod_is_allowed_with_a_warning(served: dict[str, int], pair: Pair) -> None:
    data = review(lambda r: r["object"]["spec"]["containers"][0]["resources"]["limits"].update(
        {"nvidia.com/gpu": "lots"}))
    response = _post(pair, served["port"], json.dumps(data).encode()).json()["response"]
    assert response["allowed"] is True and "patch" not in response
    assert response["warnings"][0].startswith("gpu-topology webhook left the pod to its scheduler: ")


BAD: dict[str, tuple[bytes, int, str]] = {
    "not JSON": (b"{nope", 400, "not valid JSON"),
    "empty": (b"", 400, "empty body"),
    "gzip": (gzip.compress(REQUEST_RAW), 400, "gzip-compressed"),
    "not UTF-8": (b'{"kind": "\xff"}', 400, "not UTF-8"),
    "a pod, not a review": (json.dumps(review()["request"]["object"]).encode(), 400, "expected kind AdmissionReview"),
    "no uid": (json.dumps(review(lambda r: r.pop("uid"))).encode(), 400, "request.uid"),
    "deeply nested": (b"[" * 100_000 + b"]" * 100_000, 413, "exceeds the limit"),
    "too large": (REQUEST_RAW[:-1] + b', "pad": "' + b"x" * LIMIT + b'"}', 413, "exceeds the limit"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_what_is_not_a_review_gets_a_clear_4xx(served: dict[str, int], pair: Pair, case: str) -> None:
    body, code, says = BAD[case]
    answer = _post(pair, served["port"], body)
    assert answer.status_code == code and says in answer.json()["error"], answer.text


def test_json_nested_past_the_parsers_depth_is_a_400(served: dict[str, int], pair: Pair) -> None:
    answer = _post(pair, served["port"], b"[" * 2000 + b"]" * 2000)
    assert answer.status_code == 400 and "not valid JSON" in answer.json()["error"]


def _tls_socket(pair: Pair, port: int) -> ssl.SSLSocket:
    context = ssl.create_default_context(cafile=str(pair.ca))
    return context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=WAIT), server_hostname="localhost")


def _closed(sock: ssl.SSLSocket) -> bool:
    try:
        return sock.recv(1) == b""
    except (ConnectionError, ssl.SSLError):
        return True


def test_a_client_that_never_finishes_its_head_or_body_is_cut_off(served: dict[str, int], pair: Pair) -> None:
    """--header-timeout and --body-timeout of 1 s: the connection is closed; the server keeps answering others."""
    with _tls_socket(pair, served["port"]) as slow_head:
        slow_head.sendall(b"POST /mutate HTTP/1.1\r\nHost: x\r\n")
        with _tls_socket(pair, served["port"]) as slow_body:
            slow_body.sendall(b"POST /mutate HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
            assert _closed(slow_head) and _closed(slow_body)
    assert _post(pair, served["port"], REQUEST_RAW).status_code == 200
    with httpx.Client(base_url=f"http://127.0.0.1:{served['metrics_port']}") as metrics:
        text = metrics.get("/metrics").text
    assert 'gpu_extender_http_connections_closed_total{listener="webhook",reason="head_timeout"}' in text
    assert 'gpu_extender_http_connections_closed_total{listener="webhook",reason="body_timeout"}' in text


def test_plain_http_gets_no_answer_on_the_https_port(served: dict[str, int]) -> None:
    with pytest.raises(httpx.HTTPError):
        httpx.post(f"http://127.0.0.1:{served['port']}/mutate", content=REQUEST_RAW, timeout=10)


def test_probes_and_metrics(served: dict[str, int], pair: Pair) -> None:
    """The kubelet's HTTPS probes (no certificate check) and the plain-HTTP metrics listener; reviews counted."""
    _post(pair, served["port"], REQUEST_RAW)
    with httpx.Client(base_url=f"https://127.0.0.1:{served['port']}", verify=False) as probe:
        assert probe.get("/healthz").text == "ok" and probe.get("/readyz").text == "ok"
    with httpx.Client(base_url=f"http://127.0.0.1:{served['metrics_port']}") as metrics:
        assert metrics.get("/healthz").status_code == 200
        assert metrics.post("/mutate", content=REQUEST_RAW).status_code in (404, 405), "no reviews on plain HTTP"
        text = metrics.get("/metrics").text
    patched = next(line for line in text.splitlines()
                   if line.startswith('gpu_extender_webhook_reviews_total{outcome="patched"}'))
    assert float(patched.split()[-1]) >= 1
    assert "gpu_extender_webhook_bad_requests_total" in text and "gpu_extender_webhook_review_seconds" in text


def test_a_renewed_certificate_is_served_without_a_restart(workdir: Path) -> None:
    """cert-manager renews the Secret and the kubelet swaps its files: new connections get the new certificate."""
    live = workdir / "live"
    live.mkdir()
    old, new = make_pair(live, "old"), make_pair(workdir, "new")
    with webhook(workdir, old, "--certificate-check-interval", "0.1") as ports:
        assert _post(old, ports["port"], REQUEST_RAW).status_code == 200
        shutil.copy(new.key, old.key)
        shutil.copy(new.cert, old.cert)
        deadline = time.monotonic() + WAIT
        while True:
            try:
                answer = _post(Pair(new.ca, new.cert, new.key), ports["port"], REQUEST_RAW)
                break
            except httpx.ConnectError:  # still the old certificate: the new CA does not trust it
                assert time.monotonic() < deadline, "the renewed certificate was never served"
                time.sleep(0.1)
        assert answer.status_code == 200 and decoded_patch(answer.json()) == PATCH
        with httpx.Client(base_url=f"http://127.0.0.1:{ports['metrics_port']}") as metrics:
            assert 'gpu_extender_webhook_certificate_reloads_total{result="done"} 1.0' in metrics.get("/metrics").text


def test_https_only_and_a_bad_certificate_are_refused_at_start(workdir: Path, pair: Pair) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_EXTENDER_")}
    plain = subprocess.run([str(GPU_EXTENDER), "webhook", "--port", str(free_port())], capture_output=True,
                           text=True, timeout=60, env=env)
    assert plain.returncode == 2 and "HTTPS only" in plain.stderr
    mismatched = subprocess.run([str(GPU_EXTENDER), "webhook", "--host", "127.0.0.1", "--port", str(free_port()),
                                 "--tls-cert", str(pair.cert), "--tls-key", str(pair.ca)],
                                capture_output=True, text=True, timeout=60, env=env)
    assert mismatched.returncode == 1 and "cannot load the certificate" in mismatched.stderr
    default = subprocess.run([str(GPU_EXTENDER), "webhook", "--scheduler-name", "default-scheduler",
                              "--tls-cert", str(pair.cert), "--tls-key", str(pair.key)],
                             capture_output=True, text=True, timeout=60, env=env)
    assert default.returncode == 2 and "scheduler_name" in default.stderr
