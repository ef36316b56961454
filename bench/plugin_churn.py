"""Clean logs while the plugin replaces its server under load: `python -m bench.plugin_churn [--restarts N]
[--burners B] [--plugin-src DIR]`.

Runs `gpuplugin run --topology` as a real process against the kubelet simulator, with B processes burning CPU
(default 2: on a 2-core machine every thread of the plugin waits for a core, which is when shutdown races show),
extra ListAndWatch streams reopened as fast as they end and Allocate / GetPreferredAllocation calls in flight, and
restarts the kubelet N times (each restart deletes the plugin's socket: the plugin replaces its gRPC server). Then
it reads everything the process wrote to stdout and stderr and counts incidents: a block of lines that are not one
JSON object each (a raw traceback, asyncio's or gRPC's own text), a JSON line at level error or critical, a line
that carries a traceback. The figure to watch is the incident count per N restarts; the suite runs the same driver
with fewer restarts (tests/reliability/test_plugin_churn_logs.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from bench.common import SHARED, burning, machine_line
from gpuplugin.proto import deviceplugin_pb2 as pb
from gpuplugin.proto import deviceplugin_pb2_grpc as pb_grpc
from sim.kubelet import AdmissionError, KubeletSimulator, SimulatorError

TOPOLOGY = SHARED / "topologies" / "dgx-a100-8gpu-10nic-1mcprddgx05.txt"
RESOURCE = "nvidia.com/gpu"
SOCKET_NAME = "gpu-topology.sock"
GPUS = 8
BAD_LEVELS = frozenset({"error", "critical", "exception"})


@dataclass
class Churn:
    """What one run saw: restarts driven, restarts that did not settle in time, calls made, and the incidents
    found in the plugin's output (one short description each)."""

    restarts: int = 0
    unsettled: int = 0
    calls: int = 0
    streams: int = 0
    lines: int = 0
    incidents: list[str] = field(default_factory=list)
    exit_code: int | None = None
    seconds: float = 0.0


def incidents(text: str) -> tuple[int, list[str]]:
    """(lines, incidents) of a process's output: each run of consecutive non-JSON lines is one incident, so is
    each JSON line at level error/critical or with a traceback in it."""
    found: list[str] = []
    raw: list[str] = []
    lines = text.splitlines()

    def flush() -> None:
        if raw:
            found.append("raw text: " + " | ".join(raw)[:600])
            raw.clear()

    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            entry = None
        if not isinstance(entry, dict):
            raw.append(line)
            continue
        flush()
        level = str(entry.get("level", "")).lower()
        if level in BAD_LEVELS or "Traceback" in line or "exception" in entry:
            found.append(f"{level}: {line[:600]}")
    flush()
    return len(lines), found


class Clients:
    """Load on the plugin besides the kubelet's own stream: threads that reopen ListAndWatch on our socket as soon
    as it ends, and threads that ask GetPreferredAllocation then Allocate through the kubelet's current endpoint,
    so that every server replacement cuts streams and calls in flight."""

    def __init__(self, sim: KubeletSimulator, plugin_dir: Path, streams: int = 2, callers: int = 2) -> None:
        self._sim = sim
        self._socket = plugin_dir / SOCKET_NAME
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.calls = 0
        self.streams = 0
        self._threads = [threading.Thread(target=self._stream, name=f"churn-stream-{i}", daemon=True)
                         for i in range(streams)]
        self._threads += [threading.Thread(target=self._call, name=f"churn-call-{i}", daemon=True)
                          for i in range(callers)]

    def start(self) -> Clients:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)

    def _stream(self) -> None:
        while not self._stop.is_set():
            with grpc.insecure_channel(f"unix:{self._socket}",
                                       options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
                call = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty(), timeout=5)
                try:
                    for _ in call:
                        with self._lock:
                            self.streams += 1
                        if self._stop.is_set():
                            break
                except grpc.RpcError:
                    pass
                finally:
                    call.cancel()
            self._stop.wait(0.005)

    def _call(self) -> None:
        ids = [f"GPU-{i}" for i in range(GPUS)]
        while not self._stop.is_set():
            try:
                devices = self._sim.devices(RESOURCE)
                if devices:
                    ids = [d.id for d in devices]
                chosen = self._sim.preferred(RESOURCE, ids, [], 2)
                self._sim.allocate(RESOURCE, chosen)
                with self._lock:
                    self.calls += 1
            except (SimulatorError, AdmissionError, ValueError):  # no endpoint now, or its channel just closed
                self._stop.wait(0.002)


def _gpuplugin(source: Path | None) -> tuple[list[str], dict[str, str]]:
    cmd = [sys.executable, "-c", "from gpuplugin.cli import main; main()", "run", "--topology", str(TOPOLOGY),
           "--metrics-port", "0", "--no-publish", "--log-level", "info"]
    env = dict(os.environ)
    if source is not None:
        env["PYTHONPATH"] = str(source)
    return cmd, env


def run(restarts: int, *, burners: int = 2, settle_s: float = 15.0, source: Path | None = None,
        work_dir: Path | None = None, keep_log: Path | None = None) -> Churn:
    """Drive `restarts` kubelet restarts against a real plugin process under load (see the module docstring)."""
    result = Churn()
    began = time.monotonic()
    top = Path(tempfile.mkdtemp(prefix="pc-", dir=str(work_dir) if work_dir else "/tmp"))
    plugin_dir = top / "dp"
    log_path = top / "plugin.log"
    cmd, env = _gpuplugin(source)
    try:
        with KubeletSimulator(plugin_dir) as sim, open(log_path, "wb") as log_file, burning(burners):
            proc = subprocess.Popen([*cmd, "--device-plugin-dir", str(plugin_dir)], stdout=log_file,
                                    stderr=subprocess.STDOUT, env=env, cwd=source)
            clients: Clients | None = None
            try:
                sim.wait_for_devices(RESOURCE, GPUS, settle_s * 2)
                clients = Clients(sim, plugin_dir).start()
                for _ in range(restarts):
                    sim.restart()
                    generation = sim.generation
                    result.restarts += 1
                    try:
                        sim.wait_for_registrations(RESOURCE, generation, settle_s)
                        sim.wait_for_devices(RESOURCE, GPUS, settle_s)
                    except TimeoutError:
                        result.unsettled += 1
            finally:
                if clients is not None:
                    clients.stop()
                    result.calls, result.streams = clients.calls, clients.streams
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                try:
                    result.exit_code = proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    result.exit_code = proc.wait()
        result.lines, result.incidents = incidents(log_path.read_text(errors="replace"))
        if keep_log is not None:
            shutil.copy(log_path, keep_log)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    result.seconds = time.monotonic() - began
    return result


def _kind(incident: str) -> str:
    """A short name for what an incident is, to count them by cause."""
    for needle, kind in (("Got goaway", "gRPC core's GOAWAY line"), ("Task was destroyed", "task destroyed pending"),
                         ("Event loop is closed", "event loop is closed"), ("ExecuteBatchError", "ExecuteBatchError"),
                         ("GeneratorExit", "GeneratorExit"), ("Traceback", "other traceback")):
        if needle in incident:
            return kind
    return "raw text" if incident.startswith("raw text") else incident.split(":", 1)[0] + " level"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=2000)
    parser.add_argument("--burners", type=int, default=2)
    parser.add_argument("--plugin-src", type=Path, default=None, help="run the plugin from this checkout")
    parser.add_argument("--show", type=int, default=10, help="incidents to print")
    parser.add_argument("--keep-log", type=Path, default=None, help="copy the plugin's output here")
    args = parser.parse_args()

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))  # errors only, in this process

    result = run(args.restarts, burners=args.burners, source=args.plugin_src, keep_log=args.keep_log)
    print(f"plugin from {args.plugin_src or 'this checkout'}; {machine_line()}; {args.burners} CPU burners")
    print(f"  {result.restarts} kubelet restarts in {result.seconds:.0f} s ({result.unsettled} not settled), "
          f"{result.calls} admissions, {result.streams} stream messages to extra clients")
    print(f"  {result.lines} output lines, exit code {result.exit_code}")
    print(f"  incidents: {len(result.incidents)} per {result.restarts} restarts")
    kinds = Counter(_kind(line) for line in result.incidents)
    print("  by kind: " + (", ".join(f"{kind} {n}" for kind, n in kinds.most_common()) or "none"))
    for line in result.incidents[:args.show]:
        print(f"    {line}")


if __name__ == "__main__":
    main()
