"""A stand-in for `nvidia-cuda-mps-control` that speaks its pipe protocol, for CI (no GPU, no CUDA).

`-d` starts a background daemon serving the pipe directory ($CUDA_MPS_PIPE_DIRECTORY) and returns, as the real one
does; without `-d` it is a client: commands on stdin, one per line, answers on stdout, exit 1 when no daemon
answers. The daemon keeps the defaults it is told (set_default_active_thread_percentage,
set_default_device_pinned_mem_limit) and reports them, answers `get_server_list` (no servers: no CUDA client ever
connects here); `quit` ends it. The pipe directory holds what the real daemon's does, as bench.mps_limits recorded
it on the H200 (bench/results/mps_limits.md): the `control` socket, `control_lock` (held while it lives, so a second
`-d` is refused) and `nvidia-cuda-mps-control.pid`; the daemon is a session leader; `quit` removes the pid file
and leaves the socket file behind, and a killed daemon leaves all three. It ends itself after `MAX_LIFE_S` so a
test that dies cannot leave it behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import sys
import time
from pathlib import Path

MAX_LIFE_S = 120.0
PID_FILE = "nvidia-cuda-mps-control.pid"


def _sock(pipe: Path) -> Path:
    return pipe / "control"


def _serve(pipe: Path, lock: int) -> None:
    path = _sock(pipe)
    path.unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen(8)
    server.settimeout(1.0)
    (pipe / PID_FILE).write_text(str(os.getpid()))
    threads, limits = "100.0", {}
    end = time.monotonic() + MAX_LIFE_S
    while time.monotonic() < end:
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        with conn:
            try:
                conn.settimeout(5.0)
                words = conn.makefile().readline().split()
            except OSError:  # a client that went away is not the daemon's problem
                continue
            if not words:
                continue
            if words[0] == "quit":
                (pipe / PID_FILE).unlink(missing_ok=True)
                with contextlib.suppress(OSError):
                    conn.sendall(b"\n")
                break
            if words[0] == "get_default_active_thread_percentage":
                answer = threads
            elif words[0] == "get_server_list":
                answer = ""
            elif words[0] == "set_default_active_thread_percentage" and len(words) == 2:
                threads, answer = f"{float(words[1]):.1f}", ""
            elif words[0] == "set_default_device_pinned_mem_limit" and len(words) == 3:
                limits[words[1]], answer = words[2], ""
            elif words[0] == "get_default_device_pinned_mem_limit" and len(words) == 2:
                answer = limits.get(words[1], "0")
            else:
                answer = f"unknown command {words[0]}"
            with contextlib.suppress(OSError):
                conn.sendall(answer.encode() + b"\n")
    server.close()  # the socket file stays, as the real daemon's does
    os.close(lock)


def _ask(pipe: Path, line: str) -> str | None:
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(2.0)
            s.connect(str(_sock(pipe)))
            s.sendall(line.encode() + b"\n")
            return s.makefile().readline().rstrip("\n")
    except OSError:
        return None


def main() -> int:
    pipe = Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
    if sys.argv[1:] == ["-d"]:
        lock = os.open(pipe / "control_lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print("An instance of this daemon is already running", file=sys.stderr)
            return 1
        if os.fork() == 0:
            os.setsid()
            devnull = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(devnull, fd)
            _serve(pipe, lock)
            os._exit(0)
        os.close(lock)  # the child holds the lock (flock locks belong to the open file, shared across fork)
        end = time.monotonic() + 5.0
        while _ask(pipe, "get_default_active_thread_percentage") is None:
            if time.monotonic() > end:
                return 1
            time.sleep(0.01)
        return 0
    for line in sys.stdin:
        if not line.strip():
            continue
        answer = _ask(pipe, line.strip())
        if answer is None:
            print("Cannot find MPS control daemon process", file=sys.stderr)
            return 1
        if answer:
            print(answer)
    return 0


if __name__ == "__main__":
    sys.exit(main())
