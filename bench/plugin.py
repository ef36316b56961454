"""Device plugin figures: `python -m bench.plugin [--quick]`, written to bench/results/plugin.md.

- GetPreferredAllocation round trip over the unix socket, as the kubelet simulator calls it, against `gpuplugin run
  --topology FILE` in its own process: p50 / p99 at 8 GPUs (DGX-1 hybrid cube-mesh, DGX A100) and 16 GPUs
  (DGX-2-like NVSwitch, 16-GPU PCIe bridge server). Two request mixes: the whole node free with sizes 1..n (the
  allocator's memo answers repeats), and random free sets and sizes (first-time questions, except that up to
  10 GPUs the plugin's start-up prewarm has answered every free set). Target p99 <= 2 ms.
- Re-registration after a simulated kubelet restart (every socket deleted, kubelet.sock recreated), same process:
  time from the restart until the simulator holds the complete device list again. Target <= 2 s.
- Health event to ListAndWatch update: `ResourceManager.set_health` in-process until the simulator holds the new
  list. Target <= 1 s.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, SHARED, machine_line, markdown_table, percentile
from gpuplugin.deviceplugin.lifecycle import PluginRunner
from gpuplugin.deviceplugin.resource import ResourceManager
from gputopo.core import Topology, topology_to_json
from gputopo.discovery.loader import load_topology_file
from sim.kubelet import KubeletSimulator
from sim.machines import nvswitch_node, pcie_bridge_server

RESOURCE = "nvidia.com/gpu"
WAIT = 30.0


def _topologies() -> list[tuple[str, Topology]]:
    return [
        ("DGX-1 V100 hybrid cube-mesh (8)", load_topology_file(SHARED / "topologies" / "dgx1-v100-ucxpy.txt")),
        ("DGX A100 NVSwitch (8)", load_topology_file(SHARED / "topologies" / "dgx-a100-8gpu-10nic-1mcprddgx05.txt")),
        ("DGX-2-like NVSwitch (16)", nvswitch_node(16, 6, 2)),
        ("PCIe bridge pairs, 2 sockets (16)", pcie_bridge_server(16)),
    ]


class PluginProcess:
    """`gpuplugin run --topology` in its own process, stopped with SIGTERM; the plugin's code from `source` (another
    checkout, to measure old against new with the same simulator) when given."""

    def __init__(self, topo: Topology, plugin_dir: Path, source: Path | None = None) -> None:
        self._file = plugin_dir.parent / f"{plugin_dir.name}-topology.json"
        self._file.write_text(topology_to_json(topo))
        cmd = [sys.executable, "-c", "from gpuplugin.cli import main; main()", "run", "--topology", str(self._file)]
        cmd += ["--device-plugin-dir", str(plugin_dir), "--metrics-port", "0", "--no-publish", "--log-level", "warning"]
        env = None if source is None else {**os.environ, "PYTHONPATH": str(source)}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                                     cwd=source)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=WAIT)
        self._file.unlink(missing_ok=True)
        if self.proc.returncode != 0:
            raise RuntimeError(f"plugin exited {self.proc.returncode}: {err[-2000:]}")


def _round_trips(sim: KubeletSimulator, requests: list[tuple[list[str], int]]) -> list[float]:
    """Seconds per GetPreferredAllocation call, one container request each, as the kubelet sends them."""
    times = []
    for free, size in requests:
        start = time.perf_counter()
        answer = sim.preferred_raw(RESOURCE, free, [], size)
        times.append(time.perf_counter() - start)
        if len(answer) != size:
            raise RuntimeError(f"plugin answered {answer} for size {size}")
    return times


def _ms(values: list[float], q: float) -> str:
    return f"{percentile(values, q) * 1000:.2f}"


def bench_preferred(calls: int) -> list[list[object]]:
    rows: list[list[object]] = []
    for name, topo in _topologies():
        plugin_dir = Path(tempfile.mkdtemp(prefix="bp-", dir="/tmp"))
        sim = KubeletSimulator(plugin_dir).start()
        plugin = PluginProcess(topo, plugin_dir)
        try:
            ids = [d.id for d in sim.wait_for_devices(RESOURCE, topo.size, WAIT)]
            rng = random.Random(1)
            # Warm the channel and ask every whole-node size once (the plugin prewarms these itself at start).
            _round_trips(sim, [(ids, size) for size in range(1, topo.size + 1)] * 2)
            full = _round_trips(sim, [(ids, 1 + i % topo.size) for i in range(calls)])
            requests = []
            for _ in range(calls):
                free = rng.sample(ids, rng.randint(2, topo.size))
                requests.append((free, rng.randint(1, len(free))))
            mixed = _round_trips(sim, requests)
        finally:
            plugin.stop()
            sim.stop()
            shutil.rmtree(plugin_dir, ignore_errors=True)
        for mix, values in (
            ("whole node free, sizes 1..n (allocator memo hits)", full),
            ("random free set and size (first-time; prewarmed up to 10 GPUs)", mixed),
        ):
            rows.append([name, mix, len(values), _ms(values, 50), _ms(values, 99), f"{max(values) * 1000:.2f}"])
            print(rows[-1], flush=True)
    return rows


def bench_reregistration(restarts: int) -> tuple[list[float], list[float]]:
    """(from restart() called, from kubelet.sock recreated) until the complete list is back, per restart."""
    topo = load_topology_file(SHARED / "topologies" / "dgx1-v100-ucxpy.txt")
    plugin_dir = Path(tempfile.mkdtemp(prefix="br-", dir="/tmp"))
    sim = KubeletSimulator(plugin_dir).start()
    plugin = PluginProcess(topo, plugin_dir)
    total, from_socket = [], []
    try:
        sim.wait_for_devices(RESOURCE, topo.size, WAIT)
        for n in range(restarts):
            start = time.perf_counter()
            sim.restart()  # returns once the new kubelet.sock is served
            recreated = time.perf_counter()
            sim.wait_for_registrations(RESOURCE, n + 2, WAIT)
            sim.wait_for_devices(RESOURCE, topo.size, WAIT)
            done = time.perf_counter()
            total.append(done - start)
            from_socket.append(done - recreated)
    finally:
        plugin.stop()
        sim.stop()
        shutil.rmtree(plugin_dir, ignore_errors=True)
    return total, from_socket


def bench_health(events: int) -> list[float]:
    topo = load_topology_file(SHARED / "topologies" / "dgx-a100-8gpu-10nic-1mcprddgx05.txt")
    plugin_dir = Path(tempfile.mkdtemp(prefix="bh-", dir="/tmp"))
    manager = ResourceManager(topo)
    times = []
    with KubeletSimulator(plugin_dir) as sim, PluginRunner(manager, plugin_dir):
        sim.wait_for_devices(RESOURCE, 8, WAIT)
        for n in range(events):
            healthy = n % 2 == 1
            start = time.perf_counter()
            manager.set_health([topo.ids[3]], healthy)
            sim.wait_for_devices(RESOURCE, 8 if healthy else 7, WAIT)
            times.append(time.perf_counter() - start)
    shutil.rmtree(plugin_dir, ignore_errors=True)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls (a smoke run)")
    args = parser.parse_args()
    calls, restarts, events = (200, 5, 20) if args.quick else (2000, 20, 200)

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))  # errors only, in this process

    load_before = os.getloadavg()
    preferred = bench_preferred(calls)
    rereg, rereg_socket = bench_reregistration(restarts)
    rereg_rows = [
        [
            "from restart() (includes the simulator's own shutdown)",
            len(rereg),
            f"{statistics.median(rereg):.3f}",
            f"{max(rereg):.3f}",
        ],
        [
            "from kubelet.sock recreated",
            len(rereg_socket),
            f"{statistics.median(rereg_socket):.3f}",
            f"{max(rereg_socket):.3f}",
        ],
    ]
    for row in rereg_rows:
        print("re-registration", row, flush=True)
    health = bench_health(events)
    print(f"health -> ListAndWatch: p50 {_ms(health, 50)} ms, p99 {_ms(health, 99)} ms", flush=True)
    load = ", ".join(f"{a:.1f} -> {b:.1f}" for a, b in zip(load_before, os.getloadavg(), strict=True))

    out = [
        "# Device plugin figures",
        "",
        f"`python -m bench.plugin{' --quick' if args.quick else ''}` on {machine_line()}; plugin and kubelet",
        "simulator share this machine (the plugin in its own process where noted), so the figures include the",
        "client's cost and any load from other work on the machine (load average 1/5/15 min, start -> end:",
        f"{load}).",
        "",
        "## GetPreferredAllocation round trip (unix socket, plugin process = `gpuplugin run --topology`)",
        "",
        markdown_table(["topology (GPUs)", "requests", "calls", "p50 ms", "p99 ms", "max ms"], preferred),
        "",
        "Target: p99 <= 2 ms.",
        "",
        "## Re-registration after a kubelet restart (plugin process)",
        "",
        "`KubeletSimulator.restart()` stops the simulated kubelet, deletes every socket in the directory (the",
        "plugin's too) and serves a new kubelet.sock; measured until the simulator holds the complete device list",
        "from the plugin's new registration. Most of the first row is the simulator closing its gRPC channel.",
        "",
        markdown_table(["measured", "restarts", "p50 s", "max s"], rereg_rows),
        "",
        "Target: <= 2 s.",
        "",
        "## Health event to ListAndWatch update (in-process plugin)",
        "",
        "From `ResourceManager.set_health` until the simulator holds the new complete list.",
        "",
        markdown_table(
            ["events", "p50 ms", "p99 ms", "max ms"],
            [[len(health), _ms(health, 50), _ms(health, 99), f"{max(health) * 1000:.2f}"]],
        ),
        "",
        "Target: <= 1 s.",
        "",
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "plugin.md").write_text("\n".join(out))
    print(f"wrote {RESULTS / 'plugin.md'}")


if __name__ == "__main__":
    main()
