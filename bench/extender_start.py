"""How long `gpu-extender serve` takes from its start to a ready `/readyz`: `python -m bench.extender_start [--runs N]`.

Cluster mode (against the in-process fake apiserver of tests/fakes/kubeapi, no nodes: the time is the process's own,
not the initial list) and standalone mode (the bundled demo inventory). A restarted extender
is out of kube-scheduler's reach for this long, so it is worth a figure; each run is a fresh process, as a pod
restart is.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from bench.common import ROOT, machine_line, markdown_table, percentile, stop_process

INVENTORY = ROOT / "examples" / "inventory.yaml"


def time_to_ready(args: list[str], timeout_s: float = 60.0) -> float:
    from sim.ports import free_port
    from tests.helpers.processes import http_ok

    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "extender.cli", "serve", "--port", str(port), "--log-level",
                             "warning", *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not http_ok(f"http://127.0.0.1:{port}/readyz"):
            if proc.poll() is not None:
                raise RuntimeError(f"gpu-extender serve {' '.join(args)} exited with {proc.returncode}")
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"gpu-extender serve {' '.join(args)} not ready after {timeout_s} s")
            time.sleep(0.02)
        return time.monotonic() - started
    finally:
        stop_process(proc, 20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    opts = parser.parse_args()
    from tests.fakes.kubeapi import FakeKubeApi

    rows = []
    with FakeKubeApi() as fake:
        for mode, args in (("cluster", ["--api-server", fake.url]), ("standalone", ["--inventory", str(INVENTORY)])):
            times = [time_to_ready(args) for _ in range(opts.runs)]
            rows.append([mode, opts.runs, f"{percentile(times, 50):.2f}", f"{max(times):.2f}"])
            print(f"{mode}: ready after p50 {percentile(times, 50):.2f} s, max {max(times):.2f} s", flush=True)
    print(machine_line())
    print(markdown_table(["mode", "starts", "to /readyz p50 s", "max s"], rows))


if __name__ == "__main__":
    main()
