"""bench.mps_processes without a GPU: processes named as NVIDIA's MPS binaries (argv[0], as the real daemon shows
in /proc) are listed, the control daemon of a run is told from another run's by its pipe directory, and a run's
leftovers are ended while the other run's stay. The MPS benchmarks themselves run on a GPU machine."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.mps_processes import control_pid, end_leftovers, mps_processes


def named(argv0: str, pipe: Path) -> subprocess.Popen[bytes]:
    """A sleeping process whose argv[0] is `argv0`, with CUDA_MPS_PIPE_DIRECTORY `pipe` (as MPS sets it)."""
    return subprocess.Popen(["bash", "-c", f"exec -a {argv0} sleep 30"], env={"CUDA_MPS_PIPE_DIRECTORY": str(pipe),
                                                                               "PATH": "/usr/bin:/bin"})


@pytest.fixture
def started() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(5)


def wait_listed(pids: set[str], timeout_s: float = 5.0) -> list[str]:
    """mps_processes() once it lists every pid (bash has exec'd by then)."""
    end = time.monotonic() + timeout_s
    while True:
        found = mps_processes()
        if pids <= {line.split()[0] for line in found} or time.monotonic() > end:
            return found
        time.sleep(0.02)


def test_a_runs_mps_processes_are_found_by_pipe_and_only_they_are_ended(tmp_path: Path, started) -> None:
    mine, other = tmp_path / "mine", tmp_path / "other"
    control = named("nvidia-cuda-mps-control", mine)
    server = named("nvidia-cuda-mps-server", mine)
    foreign = named("nvidia-cuda-mps-control", other)
    bystander = named("not-mps", mine)
    started += [control, server, foreign, bystander]
    ours = {str(control.pid), str(server.pid), str(foreign.pid)}
    found = wait_listed(ours)
    assert ours <= {line.split()[0] for line in found}
    assert str(bystander.pid) not in {line.split()[0] for line in found}
    assert f"{server.pid} nvidia-cuda-mps-server 30" in found
    assert control_pid(mine) == control.pid and control_pid(other) == foreign.pid
    assert control_pid(tmp_path / "nobody") is None

    left = end_leftovers(mine)
    assert sorted(line.split()[0] for line in left) == sorted([str(control.pid), str(server.pid)])
    assert control.wait(5) != 0 and server.wait(5) != 0  # ended by SIGTERM
    assert foreign.poll() is None and bystander.poll() is None  # another run's, and not MPS at all
