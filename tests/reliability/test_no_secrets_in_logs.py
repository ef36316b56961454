"""Nothing secret in logs: the plugin and the extender run with a kubeconfig holding a bearer token (the fake
apiserver refuses every request without it) at debug level, through their normal paths and their error paths
(401, 409, 500, dropped watches, re-lists, a scribbled plan annotation), and no piece of the token shows up in
anything they print, nor in the extender's HTTP answers.

The log must also show the events provoked, so the check cannot pass on an empty or unrelated log.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from sim.kubelet import KubeletSimulator
from sim.ports import free_port
from tests.extender.conftest import DGX1, topo
from tests.fakes.kubeapi import FakeKubeApi
from tests.fakes.kubelet_podresources import PodResourcesServer
from tests.helpers.kube import k8s_node, k8s_pod, write_kubeconfig
from tests.helpers.paths import short_dir
from tests.helpers.polling import eventually
from tests.helpers.processes import http_ok, stop_process, wait_serving
from tests.helpers.scheduler import bind_body, cache_args

NODE = "gpu-node-1"
RESOURCE = "nvidia.com/gpu"
PREFIX = "gpu-topology.io"
WAIT = 30.0  # liveness bound of every wait on a loaded 2-core machine, never a performance figure
WINDOW = 10  # any run of this many characters of the token counts as a leak


@pytest.fixture
def token() -> str:
    return secrets.token_urlsafe(32)


@pytest.fixture
def workdir() -> Iterator[Path]:
    with short_dir("secret-") as path:
        yield path


def leaks(text: str, secret: str) -> list[str]:
    return sorted({secret[i:i + WINDOW] for i in range(len(secret) - WINDOW + 1) if secret[i:i + WINDOW] in text})


def test_leak_check_finds_a_fragment() -> None:
    secret = secrets.token_urlsafe(32)
    assert leaks(f"Authorization: Bearer {secret[5:5 + WINDOW]}", secret) == [secret[5:5 + WINDOW]]
    assert leaks(f"token {secret[:WINDOW - 1]}", secret) == []


def _wait(predicate: Callable[[], bool], what: str, log: Path) -> None:
    assert eventually(predicate, WAIT), f"timed out waiting for {what}; log tail:\n{log.read_text()[-3000:]}"


def _events(log: Path) -> list[dict[str, Any]]:
    """The structured (JSON line) events of a log; uvicorn's own lines are plain text and skipped here."""
    out = []
    for line in log.read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            out.append(event)
    return out


def _relist(fake: FakeKubeApi) -> None:
    """A change no watcher is shown, the history compacted, every watch cut: watchers get 410 and list again."""
    lists = sum(1 for r in list(fake.requests) if r.method == "GET" and "watch" not in r.query)
    fake.add_pod(k8s_pod("finished", 0, "elsewhere", phase="Failed"))
    fake.expire_history()
    fake.drop_watches()
    assert fake.wait_for_requests(lambda r: r.method == "GET" and "watch" not in r.query, lists + 1, timeout=WAIT)


def test_plugin_logs_no_token(token: str, workdir: Path) -> None:
    log = workdir / "plugin.log"
    with FakeKubeApi(token=token) as fake, PodResourcesServer(str(workdir / "podres.sock")), \
            KubeletSimulator(workdir / "dp") as kubelet:
        fake.add_node(k8s_node(NODE))
        # The first list of pods is refused (401, as with a revoked token), the first read of the Node fails (500).
        fake.fail_next(1, 401, path_regex=r"^/api/v1/pods\?", method="GET")
        fake.fail_next(1, 500, path_regex=f"/nodes/{NODE}$", method="GET")
        env = dict(os.environ, KUBECONFIG=str(write_kubeconfig(workdir / "kubeconfig", fake.url, token)),
                   NODE_NAME=NODE)
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "gpuplugin.cli", "run", "--device-plugin-dir", str(workdir / "dp"),
                 "--topology", str(DGX1), "--pod-resources-socket", str(workdir / "podres.sock"),
                 "--metrics-port", "0", "--device-id-strategy", "index", "--log-level", "debug"],
                env=env, stdout=out, stderr=subprocess.STDOUT,
            )
        try:
            kubelet.wait_for_devices(RESOURCE, 8, timeout=WAIT)

            def published() -> dict[str, str]:
                return (fake.node(NODE) or {}).get("metadata", {}).get("annotations", {})

            _wait(lambda: f"{PREFIX}/topology" in published(), "publication", log)
            assert fake.wait_for_watches(1, timeout=WAIT, resource="pods")
            fake.add_pod(k8s_pod("scribbled", 0, NODE, {f"{PREFIX}/plan": "{not json"}))
            _wait(lambda: "plugin.plans.ignored" in log.read_text(), "the scribbled plan to be ignored", log)
            _relist(fake)
            assert fake.wait_for_watches(1, timeout=WAIT, resource="pods")
        finally:
            stop_process(process)
    text = log.read_text()
    assert leaks(text, token) == [], "the plugin's log holds the token"
    events = {e.get("event") for e in _events(log)}
    provoked = {"kube.client.configured", "plugin.publish.retrying", "kube.watch.error", "kube.watch.relist",
                "plugin.publish.done", "plugin.plans.ignored"}
    assert provoked <= events, f"missing {provoked - events}: the log is not the one expected"
    # Every request carried the token: without it the fake would have answered 401 to the lot.
    assert fake.node(NODE)["metadata"]["annotations"][f"{PREFIX}/topology"]




def test_extender_logs_and_answers_no_token(token: str, workdir: Path) -> None:
    log = workdir / "extender.log"
    answers: list[str] = []
    with FakeKubeApi(token=token) as fake:
        fake.add_node(k8s_node(NODE, topo(DGX1)))
        fake.fail_next(1, 500, path_regex=r"^/api/v1/nodes\?", method="GET")
        port = free_port()
        with open(log, "wb") as out:
            process = subprocess.Popen(
                [str(Path(sys.executable).parent / "gpu-extender"), "serve", "--kubeconfig",
                 str(write_kubeconfig(workdir / "kubeconfig", fake.url, token)), "--host", "127.0.0.1",
                 "--port", str(port), "--log-level", "debug"],
                stdout=out, stderr=subprocess.STDOUT,
            )
        try:
            def ready() -> bool:
                return http_ok(f"http://127.0.0.1:{port}/readyz")

            wait_serving(process, ready, WAIT, log)
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
                p1, p2, p3 = (fake.add_pod(k8s_pod(n, 2)) for n in ("p1", "p2", "p3"))

                def post(path: str, body: Any) -> dict[str, Any]:
                    reply = client.post(path, json=body)
                    answers.append(reply.text)
                    return reply.json()

                _wait(lambda: post("/filter", cache_args(p1, [NODE]))["NodeNames"] == [NODE], "p1 to fit", log)
                assert post("/bind", bind_body(p1, NODE)) == {"Error": ""}
                fake.fail_next(1, 401, path_regex=r"/pods/p2/binding$", method="POST")
                assert "Unauthorized" in post("/bind", bind_body(p2, NODE))["Error"]
                fake.fail_next(1, 409, path_regex=r"/pods/p3/binding$", method="POST")
                assert "conflict" in post("/bind", bind_body(p3, NODE))["Error"]
                _relist(fake)
                wait_serving(process, ready, WAIT, log)  # again after the re-list
                answers.append(client.get("/metrics").text)
        finally:
            stop_process(process)
    text = log.read_text()
    assert leaks(text, token) == [], "the extender's log holds the token"
    assert leaks("\n".join(answers), token) == [], "the extender's answers hold the token"
    events = {e.get("event") for e in _events(log)}
    provoked = {"kube.client.configured", "kube.watch.error", "kube.watch.relist", "extender.bind.failed",
                "kube.pod.bound"}
    assert provoked <= events, f"missing {provoked - events}: the log is not the one expected"
