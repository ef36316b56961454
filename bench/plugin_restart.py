"""Re-registration after kubelet restarts: `python -m bench.plugin_restart [--restarts N] [--plugin-src DIR]`.

Drives N kubelet restarts of the simulator, in the real kubelet's order (the old kubelet dies, every socket in the
directory is deleted, the plugin's too, and a new kubelet.sock listens well under a millisecond later), against
`gpuplugin run --topology` in its own process, one restart after the other is settled. Per restart: the time from
the new kubelet.sock listening to the kubelet accepting the plugin's registration, and to the kubelet holding the
complete device list again; restarts with no registration within `--bound` seconds, and kubelet lives that got
more than one. Prints p50 / p99 / max. `--plugin-src` runs the plugin from another checkout (main's, to compare old
and new code under the same simulator, back to back). Figures include the simulator's cost in the same machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from bench.common import SHARED, machine_line, percentile
from bench.plugin import RESOURCE, WAIT, PluginProcess
from gputopo.discovery.loader import load_topology_file
from sim.kubelet import KubeletSimulator

TOPOLOGY = SHARED / "topologies" / "dgx-a100-8gpu-10nic-1mcprddgx05.txt"


def run(restarts: int, bound: float, source: Path | None) -> dict[str, list[float] | int]:
    topo = load_topology_file(TOPOLOGY)
    plugin_dir = Path(tempfile.mkdtemp(prefix="bq-", dir="/tmp"))
    sim = KubeletSimulator(plugin_dir).start()
    plugin = PluginProcess(topo, plugin_dir, source)
    registered, listed, gaps = [], [], []
    missed = 0
    try:
        sim.wait_for_devices(RESOURCE, topo.size, WAIT)
        first = sim.generation
        for _ in range(restarts):
            listening = sim.restart()
            gaps.append(sim.last_restart_gap_s or 0.0)
            generation = sim.generation
            deadline = listening + bound
            while not sim.registration_times(RESOURCE, generation) and time.monotonic() < deadline:
                time.sleep(0.0005)
            times = sim.registration_times(RESOURCE, generation)
            if not times:
                missed += 1
                continue
            registered.append(times[0] - listening)
            try:
                sim.wait_for_devices(RESOURCE, topo.size, max(0.0, deadline - time.monotonic()))
                listed.append(time.monotonic() - listening)
            except TimeoutError:
                missed += 1
        duplicates = sum(len(sim.registration_times(RESOURCE, g)) > 1 for g in range(first + 1, sim.generation + 1))
    finally:
        plugin.stop()
        sim.stop()
        shutil.rmtree(plugin_dir, ignore_errors=True)
    return {"registered": registered, "listed": listed, "gaps": gaps, "missed": missed, "duplicates": duplicates}


def _ms(values: list[float]) -> str:
    if not values:
        return "none"
    return (f"p50 {statistics.median(values) * 1000:.1f} ms, p99 {percentile(values, 99) * 1000:.1f} ms, "
            f"max {max(values) * 1000:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=300)
    parser.add_argument("--bound", type=float, default=15.0, help="seconds a restart may take before it counts as "
                        "missed (above the kubelet's 10 s dial-back)")
    parser.add_argument("--plugin-src", type=Path, default=None, help="run the plugin from this checkout")
    args = parser.parse_args()

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))  # errors only, in this process

    load = os.getloadavg()[0]
    result = run(args.restarts, args.bound, args.plugin_src)
    source = args.plugin_src or "this checkout"
    print(f"plugin from {source}; {args.restarts} kubelet restarts; {machine_line()}; load average {load:.1f} -> "
          f"{os.getloadavg()[0]:.1f}")
    gaps = result["gaps"]
    assert isinstance(gaps, list)
    print(f"  deletion -> new kubelet.sock listening: p50 {statistics.median(gaps) * 1e6:.0f} us, "
          f"max {max(gaps) * 1e6:.0f} us")
    for key, what in (("registered", "kubelet.sock listening -> registration accepted"),
                      ("listed", "kubelet.sock listening -> complete device list held")):
        values = result[key]
        assert isinstance(values, list)
        print(f"  {what}: {_ms(values)} ({len(values)} restarts)")
    print(f"  restarts without a registration and list within {args.bound} s: {result['missed']}")
    print(f"  kubelet lives with more than one registration: {result['duplicates']}")


if __name__ == "__main__":
    main()
