"""The MPS processes on this host, read from /proc, for the MPS benchmarks (bench.mps_limits,
bench.mps_daemonset): what the real `nvidia-cuda-mps-control` started, which of them serve a benchmark's own pipe
directory (found by their environment, where no pid file names them), and ending what a run left behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


def mps_processes() -> list[str]:
    """`pid argv...` of every MPS control daemon and server running."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                argv = (p / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv and Path(os.fsdecode(argv[0])).name.startswith("nvidia-cuda-mps"):
                found.append(f"{p.name} {' '.join(os.fsdecode(a) for a in argv if a)}")
    return sorted(found)


def serves(pid: str, pipe: Path) -> bool:
    """Whether process `pid` runs with CUDA_MPS_PIPE_DIRECTORY `pipe` (one of this run's, not another's)."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"CUDA_MPS_PIPE_DIRECTORY={pipe}".encode() in environ


def control_pid(pipe: Path) -> int | None:
    """The control daemon serving `pipe`, found by its environment (where no pid file names it)."""
    for line in mps_processes():
        pid, argv0 = line.split()[:2]
        if Path(argv0).name == "nvidia-cuda-mps-control" and serves(pid, pipe):
            return int(pid)
    return None


def end_leftovers(pipe: Path) -> list[str]:
    """MPS processes of this run still there after `quit` (a server orphaned by the killed daemon): named, then
    ended by pid so the next benchmark finds the GPU as it was."""
    left = [line for line in mps_processes() if serves(line.split()[0], pipe)]
    for line in left:
        with contextlib.suppress(OSError):
            os.kill(int(line.split()[0]), signal.SIGTERM)
    return left
