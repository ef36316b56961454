"""Helpers every benchmark script shares: where fixtures and results live, percentiles, markdown tables, the
policy comparison bars."""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT / "fixtures"  # the recorded facts every benchmark shares, inside the repository (read-only)
RESULTS = ROOT / "bench" / "results"


def complete_topology_files() -> list[Path]:
    """Every shared `nvidia-smi topo -m` fixture that is complete (truncated ones are named PARTIAL)."""
    return sorted(p for p in (SHARED / "topologies").glob("*.txt") if "PARTIAL" not in p.name)


def shared_topology_files() -> list[Path]:
    """Every complete shared `nvidia-smi topo -m` fixture, plus the H200 recording's text."""
    files = complete_topology_files()
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


def keep_logs(dest: Path | None, *sources: Path) -> None:
    """Copy the logs of a run (the `*.log` files of each source folder, a control plane's or a run's own) to `dest`,
    when a `--keep-logs` asked for them."""
    if dest is None:
        return
    dest.mkdir(parents=True, exist_ok=True)
    for source in sources:
        for f in source.glob("*.log"):
            shutil.copy(f, dest)


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


def policy_bars(axes: Sequence[Any], panels: Sequence[tuple[str, Callable[[Any], float]]],
                results: Mapping[str, Any], policies: Sequence[str], colours: Sequence[str]) -> None:
    """One bar panel per metric, a bar per policy labelled by its key's prefix ("(a)") and annotated with its value:
    the comparison plot the churn benchmarks share."""
    for ax, (title, get) in zip(axes, panels, strict=True):
        vals = [get(results[p]) for p in policies]
        ax.bar(range(len(policies)), vals, color=colours)
        ax.set_xticks(range(len(policies)))
        ax.set_xticklabels([p.split(":")[0] for p in policies])
        ax.set_title(title, fontsize=9)
        for x, v in enumerate(vals):
            ax.annotate(f"{v:.2f}" if isinstance(v, float) else str(v), (x, v), ha="center", va="bottom", fontsize=8)


@contextlib.contextmanager
def burning(count: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """`count` processes spinning on a core each, killed on exit: the load under which transitions are measured
    (on a 2-core machine every thread then waits for a core, which is when shutdown and start-up races show)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
