"""The slow-client attack of issue 14 (item 2) against a real `gpu-extender serve` process, with figures.

The extender runs standalone (examples/inventory.yaml) in a child process whose open-files limit is `--nofile`
(resource.setrlimit in the child). Attack connections, held for `--seconds`: a third send a request head a byte at
a time (one byte every `--drip` seconds), a third send a head that declares a body and never send it, a third
connect and send nothing; each one that the server closes is opened again. Meanwhile a normal client POSTs /filter
(a 4-GPU pod, 7 nodes, a new connection each time, 5 s timeout) in a closed loop. Printed: p50/p99 of the normal
calls before and during the attack, their errors, how many attack connections the server closed, the log bytes
written during the attack, and the server's open fds and threads before, at peak and after:

    python -m bench.attack_extender --label new        # writes bench/results/attack-extender-new.md
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import resource
import selectors
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import RESULTS, ROOT, machine_line, markdown_table, percentile, proc_counts, stop_process
from sim.ports import free_port

INVENTORY = ROOT / "examples" / "inventory.yaml"
NODES = ["dgx1-v100-0", "dgx1-v100-1", "dgx1-v100-busy", "hgx-a100-0", "hgx-a100-1"]
TIMEOUT_S = 5.0


def body() -> bytes:
    pod = {"metadata": {"name": "p", "namespace": "default", "uid": "u-1"},
           "spec": {"containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": "4"}}}]}}
    return json.dumps({"Pod": pod, "Nodes": None, "NodeNames": NODES}).encode()


def filter_call(port: int, payload: bytes) -> float:
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT_S)
    try:
        conn.request("POST", "/filter", payload, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200 or b'"NodeNames"' not in data:
            raise RuntimeError(f"HTTP {resp.status}")
    finally:
        conn.close()
    return time.perf_counter() - start


def normal_calls(port: int, stop: threading.Event, out: list[float], errors: list[str],
                 limit: int | None = None) -> None:
    payload = body()
    while not stop.is_set() and (limit is None or len(out) + len(errors) < limit):
        try:
            out.append(filter_call(port, payload))
        except (OSError, RuntimeError, http.client.HTTPException) as e:
            errors.append(type(e).__name__)
            time.sleep(0.05)


HEADS = {
    "slow head": b"POST /filter HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nX-Pad: " + b"a" * 4000,
    "body never sent": b"POST /filter HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 100000\r\n\r\n{\"Pod\":",
    "idle": b"",
}


class Attack(threading.Thread):
    """Keeps `count` connections of each kind open; counts those the server closed."""

    def __init__(self, port: int, count: int, drip: float, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.port, self.count, self.drip, self.stop = port, count, drip, stop
        self.closed_by_server = dict.fromkeys(HEADS, 0)
        self.connect_failures = 0

    def _open(self, kind: str) -> tuple[socket.socket, str, int] | None:
        try:
            s = socket.create_connection(("127.0.0.1", self.port), timeout=1.0)
        except OSError:
            self.connect_failures += 1
            return None
        s.setblocking(False)
        head = HEADS[kind]
        sent = 0
        if kind == "body never sent":
            with contextlib.suppress(OSError):
                s.send(head)
            sent = len(head)
        return s, kind, sent

    def run(self) -> None:
        sel = selectors.DefaultSelector()
        conns: dict[socket.socket, list] = {}
        for kind in HEADS:
            for _ in range(self.count):
                got = self._open(kind)
                if got:
                    conns[got[0]] = [got[1], got[2]]
                    sel.register(got[0], selectors.EVENT_READ)
        next_drip = time.monotonic()
        while not self.stop.is_set():
            for key, _ in sel.select(timeout=0.1):
                s = key.fileobj
                try:
                    data = s.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    kind = conns.pop(s)[0]
                    self.closed_by_server[kind] += 1
                    sel.unregister(s)
                    s.close()
                    got = self._open(kind)
                    if got:
                        conns[got[0]] = [got[1], got[2]]
                        sel.register(got[0], selectors.EVENT_READ)
            if time.monotonic() >= next_drip:
                next_drip += self.drip
                for s, state in list(conns.items()):
                    if state[0] == "slow head" and state[1] < len(HEADS["slow head"]):
                        try:
                            s.send(HEADS["slow head"][state[1]:state[1] + 1])
                            state[1] += 1
                        except OSError:
                            pass
        for s in conns:
            s.close()
        sel.close()


def ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1000:.2f}"


def wait_up(port: int, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            filter_call(port, body())
            return
        except (OSError, RuntimeError, http.client.HTTPException):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the extender did not come up") from None
            time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="new", help="names the results file: attack-extender-<label>.md")
    ap.add_argument("--connections", type=int, default=100, help="attack connections of each of the three kinds")
    ap.add_argument("--drip", type=float, default=1.0, help="seconds between the slow heads' bytes")
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--nofile", type=int, default=256, help="the server's open-files limit (0: leave it)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="attack-extender-", suffix=".log", delete=False)  # noqa: SIM115

    def limit_files() -> None:
        if args.nofile:
            resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, args.nofile))

    proc = subprocess.Popen(
        [sys.executable, "-m", "extender.cli", "serve", "--inventory", str(INVENTORY), "--port", str(port),
         "--log-level", "info"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT,
        preexec_fn=limit_files)
    try:
        wait_up(port, proc)
        before = proc_counts(proc.pid)
        base: list[float] = []
        base_errors: list[str] = []
        normal_calls(port, threading.Event(), base, base_errors, limit=200)

        stop = threading.Event()
        log_before = os.path.getsize(log.name)
        attack = Attack(port, args.connections, args.drip, stop)
        attack.start()
        time.sleep(2.0)
        during: list[float] = []
        errors: list[str] = []
        caller = threading.Thread(target=normal_calls, args=(port, stop, during, errors), daemon=True)
        caller.start()
        peak = (0, 0)
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            fds, threads = proc_counts(proc.pid)
            peak = (max(peak[0], fds), max(peak[1], threads))
            time.sleep(0.2)
        stop.set()
        attack.join(10)
        caller.join(TIMEOUT_S * 3)
        log_bytes = os.path.getsize(log.name) - log_before
        time.sleep(3.0)
        after = proc_counts(proc.pid)
        rows = [
            ["POST /filter before the attack", len(base), ms(percentile(base, 50)), ms(percentile(base, 99)),
             len(base_errors)],
            ["POST /filter during the attack", len(during), ms(percentile(during, 50)), ms(percentile(during, 99)),
             f"{len(errors)} ({', '.join(sorted(set(errors))) or 'none'})"],
        ]
        closed = ", ".join(f"{k}: {v}" for k, v in attack.closed_by_server.items())
        text = f"""# Slow-client attack on the extender ({args.label})

`python -m bench.attack_extender --label {args.label}` on {machine_line()}. Server: `gpu-extender serve
--inventory examples/inventory.yaml`, open-files limit {args.nofile or 'unchanged'}. Attack: {args.connections}
connections of each kind (slow head at one byte per {args.drip} s, body declared and never sent, idle), each one the
server closes opened again, for {args.seconds:.0f} s. Normal client: POST /filter, new connection each time, 5 s
timeout, closed loop.

{markdown_table(["calls", "count", "p50 ms", "p99 ms", "errors"], rows)}

Attack connections closed by the server: {closed}; attack connects that failed: {attack.connect_failures}.
Log written during the attack: {log_bytes:,} bytes.

{markdown_table(["extender process", "before", "peak during", "after (3 s)"],
                [["open fds", before[0], peak[0], after[0]], ["threads", before[1], peak[1], after[1]]])}
"""
        print(text)
        if not args.no_write:
            RESULTS.mkdir(parents=True, exist_ok=True)
            (RESULTS / f"attack-extender-{args.label}.md").write_text(text)
            print(f"wrote {RESULTS / f'attack-extender-{args.label}.md'}")
    finally:
        stop_process(proc, 15)
        log.close()
        Path(log.name).unlink(missing_ok=True)


if __name__ == "__main__":
    main()
