"""The binaries tests run as real processes: waiting until one serves, and stopping it the way Kubernetes does."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.helpers.paths import REPO
from tests.helpers.polling import eventually


def wait_serving(process: subprocess.Popen[Any], ready: Callable[[], bool], timeout: float,
                 log: Path | None = None) -> None:
    """Wait until `ready()` (a probe of what the process serves, e.g. `accepts` or `http_ok`) holds. Fails at
    once, with the process's output (piped, or the tail of `log`), if the process exits first; after `timeout`
    if it never serves."""
    if not eventually(lambda: process.poll() is not None or ready(), timeout):
        raise AssertionError(f"pid {process.pid} not serving after {timeout} s{_log_tail(log)}")
    if process.poll() is not None:
        raise AssertionError(f"pid {process.pid} exited with status {process.returncode} before serving: "
                             f"{_piped_output(process)}{_log_tail(log)}")


def stop_process(process: subprocess.Popen[Any], timeout: float = 20.0, log: Path | None = None) -> tuple[Any, Any]:
    """SIGTERM, as the kubelet sends on pod deletion, then what is left of the process's piped (stdout, stderr);
    `process.returncode` holds its exit status. A process still running `timeout` seconds later gets SIGABRT
    (Python writes every thread's stack first, PYTHONFAULTHANDLER being set for every child by tests/conftest.py),
    then SIGKILL, and the call fails with that output: every binary must stop on SIGTERM, and a hang must say
    where it hung. Safe to call again."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        try:
            out = process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            out = process.communicate()
        raise AssertionError(f"pid {process.pid} did not exit within {timeout} s of SIGTERM (aborted): "
                             f"{_text(out)}{_log_tail(log, 12000)}") from None


def accepts(port: int) -> bool:
    """Something accepts TCP connections on 127.0.0.1:`port`."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def http_ok(url: str, client: httpx.Client | None = None) -> bool:
    """GET `url` answers 200 (through `client` when given: a base URL, TLS settings). Without one, a plain
    urllib request: a new httpx client per probe costs more CPU than the process being waited for can spare."""
    try:
        if client is not None:
            return client.get(url).status_code == 200
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except (httpx.HTTPError, OSError):  # OSError: refused, reset, timed out, urllib's HTTPError for 4xx/5xx
        return False


def _piped_output(process: subprocess.Popen[Any]) -> str:
    """What an exited process wrote to its pipes (reading a live process's pipe would block)."""
    chunks = [stream.read() for stream in (process.stdout, process.stderr) if stream is not None and not stream.closed]
    return "".join(c.decode(errors="replace") if isinstance(c, bytes) else c for c in chunks)[-3000:]


def _log_tail(log: Path | None, chars: int = 3000) -> str:
    return f"; log tail:\n{log.read_text(errors='replace')[-chars:]}" if log is not None and log.exists() else ""


def _text(out: tuple[Any, Any]) -> str:
    """A process's piped (stdout, stderr) as text, the end of it (where an abort's stacks are)."""
    return "".join(c.decode(errors="replace") if isinstance(c, bytes) else c for c in out if c)[-12000:]


class ExtenderProcess:
    """`gpu-extender serve --api-server URL` as a real process on a free port (`args` added to its flags), ready
    when this returns; its log goes to a file."""

    def __init__(self, api_url: str, log: Path, wait: float, *args: str) -> None:
        self.log = log
        self.wait = wait
        self._file = log.open("wb")
        self.client: httpx.Client | None = None
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "extender.cli", "serve", "--api-server", api_url, "--port", "0",
             "--log-level", "info", *args],
            cwd=REPO, stdout=self._file, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            wait_serving(self.proc, lambda: self._port() is not None, 2 * wait, self.log)
            self.client = httpx.Client(base_url=f"http://127.0.0.1:{self._port()}", timeout=wait)
            assert eventually(lambda: http_ok("/readyz", self.http), wait), (
                f"extender not ready: {self.log.read_text()[-2000:]}")
        except BaseException:
            self.stop(signal.SIGKILL)
            raise

    @property
    def http(self) -> httpx.Client:
        assert self.client is not None
        return self.client

    def _port(self) -> str | None:
        """The port the process says it listens on (it was started on port 0)."""
        text = self.log.read_text(errors="replace")
        m = re.search(r'"port": (\d+),[^\n]*"event": "extender.server.listening"', text)
        return m.group(1) if m else None

    def gauge(self, name: str) -> float:
        """A sample's value, `name` with its labels as /metrics writes them (0 when absent)."""
        text = self.http.get("/metrics").text
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Stop it with `sig` (SIGKILL plays a crash); its exit status."""
        try:
            if sig == signal.SIGTERM:
                stop_process(self.proc, self.wait)
            elif self.proc.poll() is None:
                self.proc.send_signal(sig)
                self.proc.wait(self.wait)
            return self.proc.returncode
        finally:
            self._file.close()
            if self.client is not None:
                self.client.close()
