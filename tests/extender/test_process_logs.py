"""What `gpu-extender serve` and `gpu-extender webhook` write as real processes, each with its metrics listener beside
the main one and its output on a file (not a terminal: JSON lines): every line one JSON object a collector can
parse, no terminal colours in it, and the process's start said once although two uvicorn servers run in it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from sim.ports import free_ports
from tests.extender.conftest import A100, write_inventory
from tests.extender.webhook.pki import make_pair
from tests.helpers.paths import REPO
from tests.helpers.processes import accepts, stop_process, wait_serving

WAIT = 60.0  # liveness bound for a process start on a loaded machine, not a performance figure


def _command(kind: str, directory: Path, port: int, metrics_port: int) -> list[str]:
    listen = ["--host", "127.0.0.1", "--port", str(port), "--metrics-host", "127.0.0.1",
              "--metrics-port", str(metrics_port), "--log-level", "info"]
    if kind == "serve":
        inventory = write_inventory(directory / "inv.yaml", [{"name": "a100", "topology": A100}])
        return [sys.executable, "-m", "extender.cli", "serve", "--inventory", str(inventory), *listen]
    pair = make_pair(directory, "a")
    return [sys.executable, "-m", "extender.cli", "webhook", "--tls-cert", str(pair.cert), "--tls-key",
            str(pair.key), *listen]


@pytest.fixture(scope="module", params=["serve", "webhook"])
def output(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """The lines one run wrote, from its start (both listeners accepting) to its end on SIGTERM."""
    directory = tmp_path_factory.mktemp(request.param)
    port, metrics_port = free_ports(2)
    log = directory / "out.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPU_EXTENDER_")} | {"PYTHONUNBUFFERED": "1"}
    with log.open("wb") as out:
        process = subprocess.Popen(_command(request.param, directory, port, metrics_port), cwd=REPO, env=env,
                                   stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_serving(process, lambda: accepts(port) and accepts(metrics_port), WAIT, log)
        finally:
            stop_process(process, log=log)
    yield log.read_text(errors="replace").splitlines()


def _entries(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines]


def test_every_line_is_json_without_terminal_colours(output: list[str]) -> None:
    """uvicorn passes an ANSI-coloured twin of some messages ("Started server process") in `color_message`."""
    assert output
    for line in output:
        assert isinstance(json.loads(line), dict), line
        assert "color_message" not in line and "\\u001b[" not in line and "\x1b[" not in line, line


def test_the_process_start_and_stop_are_said_once(output: list[str]) -> None:
    """The metrics listener is a second uvicorn server in the same process; its own "Started server process" line
    said the process started twice."""
    messages = [e.get("message", "") for e in _entries(output)]
    assert sum(m.startswith("Started server process") for m in messages) == 1, output
    assert sum(m == "Shutting down" for m in messages) == 1, output
    assert sum(m.startswith("Finished server process") for m in messages) <= 1, output
