"""Helpers every benchmark script shares: where fixtures and results live, percentiles, markdown tables."""

from __future__ import annotations

import atexit
import math
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT / "fixtures"  # the recorded facts every benchmark shares, inside the repository (read-only)
RESULTS = ROOT / "bench" / "results"


def shared_topology_files() -> list[Path]:
    """Every shared `nvidia-smi topo -m` fixture that is complete, plus the H200 recording's text."""
    files = sorted(p for p in (SHARED / "topologies").glob("*.txt") if "PARTIAL" not in p.name)
    h200 = SHARED / "recordings" / "h200x2-vm-nvidia-smi-topo-m.txt"
    return [*files, h200] if h200.exists() else files


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    k = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def machine_line() -> str:
    import os

    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def scratch(prefix: str) -> Path:
    """A temporary directory for one benchmark run (inventories, sockets), removed when the process exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def proc_counts(pid: int) -> tuple[int, int]:
    """(open fds, threads) of a process."""
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def stop_process(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not ended within `timeout_s`."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout_s)
