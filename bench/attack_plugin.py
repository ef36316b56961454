"""The ListAndWatch attack of issue 14 (item 1) against a real `gpuplugin run` process, with figures.

A kubelet simulator registers the plugin (a subprocess on a DGX-1 topology file, so its open files and threads can
be read from /proc). Then, for `--seconds`, attackers open `--streams` ListAndWatch streams on the plugin's socket,
hold them `--hold` seconds, drop them and open them again, while a "kubelet" makes normal admission calls
(GetPreferredAllocation then Allocate, 5 s deadline each) in a closed loop; halfway through, the kubelet restarts
(deleting every socket) and has to get the plugin registered again. Printed: p50/p99 of the normal calls before
and during the attack, their errors, the re-registration time, and the plugin's open fds and threads before,
at peak and after. Run from a checkout to measure that checkout's code:

    python -m bench.attack_plugin --label new          # writes bench/results/attack-plugin-new.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

from bench.common import RESULTS, ROOT, machine_line, markdown_table, percentile, proc_counts, stop_process
from gpuplugin.proto import deviceplugin_pb2 as pb
from gpuplugin.proto import deviceplugin_pb2_grpc as pb_grpc
from sim.kubelet import KubeletSimulator

RESOURCE = "nvidia.com/gpu"
TOPOLOGY = ROOT / "gputopo" / "data" / "dgx1-v100-hybrid-cube-mesh.txt"
DEADLINE_S = 5.0


class Sampler(threading.Thread):
    """Peak fds and threads of a process while it runs."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak = (0, 0)
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.1):
            fds, threads = proc_counts(self.pid)
            self.peak = (max(self.peak[0], fds), max(self.peak[1], threads))


def admission(stub: pb_grpc.DevicePluginStub, ids: list[str]) -> float:
    """One admission: preference of 4, then Allocate of it. Seconds; raises grpc.RpcError."""
    start = time.perf_counter()
    pref = stub.GetPreferredAllocation(pb.PreferredAllocationRequest(container_requests=[
        pb.ContainerPreferredAllocationRequest(available_deviceIDs=ids, allocation_size=4)]), timeout=DEADLINE_S)
    chosen = list(pref.container_responses[0].deviceIDs) or ids[:4]
    stub.Allocate(pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=chosen)]),
                  timeout=DEADLINE_S)
    return time.perf_counter() - start


def normal_calls(socket: Path, ids: list[str], stop: threading.Event, out: list[float], errors: list[str],
                 limit: int | None = None) -> None:
    """Admissions in a closed loop until `stop` (or `limit` calls); a fresh channel after an error (the socket may
    have been recreated by a kubelet restart)."""
    channel = grpc.insecure_channel(f"unix:{socket}")
    stub = pb_grpc.DevicePluginStub(channel)
    while not stop.is_set() and (limit is None or len(out) + len(errors) < limit):
        try:
            out.append(admission(stub, ids))
        except grpc.RpcError as e:
            errors.append(e.code().name)
            channel.close()
            time.sleep(0.05)
            channel = grpc.insecure_channel(f"unix:{socket}")
            stub = pb_grpc.DevicePluginStub(channel)
    channel.close()


def attacker(socket: Path, streams: int, hold: float, stop: threading.Event, stats: dict[str, int]) -> None:
    """Open `streams` ListAndWatch streams, hold them, drop them, again, until `stop`."""
    while not stop.is_set():
        channel = grpc.insecure_channel(f"unix:{socket}")
        stub = pb_grpc.DevicePluginStub(channel)
        calls = [stub.ListAndWatch(pb.Empty()) for _ in range(streams)]
        stats["opened"] += streams
        stop.wait(hold)
        for call in calls:
            if call.done() and call.code() is grpc.StatusCode.RESOURCE_EXHAUSTED:
                stats["refused"] += 1
            call.cancel()
        channel.close()


def ms(seconds: float) -> str:
    return "-" if seconds != seconds else f"{seconds * 1000:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", default="new", help="names the results file: attack-plugin-<label>.md")
    ap.add_argument("--streams", type=int, default=50)
    ap.add_argument("--hold", type=float, default=0.5)
    ap.add_argument("--attackers", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="atk-", dir="/tmp"))
    socket = workdir / "gpu-topology.sock"
    kubelet = KubeletSimulator(workdir, dial_timeout=10.0).start()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", "from gpuplugin.cli import main; main()", "run", "--topology", str(TOPOLOGY),
         "--device-plugin-dir", str(workdir), "--metrics-port", "0", "--no-publish", "--log-level", "error"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows: list[list[object]] = []
    try:
        ids = [d.id for d in kubelet.wait_for_devices(RESOURCE, 8, 30)]
        time.sleep(3.0)  # let the allocator prewarm finish before the baseline
        before = proc_counts(proc.pid)
        base: list[float] = []
        base_errors: list[str] = []
        normal_calls(socket, ids, threading.Event(), base, base_errors, limit=300)

        stop = threading.Event()
        stats = {"opened": 0, "refused": 0}
        sampler = Sampler(proc.pid)
        sampler.start()
        attackers = [threading.Thread(target=attacker, args=(socket, args.streams, args.hold, stop, stats),
                                      daemon=True) for _ in range(args.attackers)]
        for t in attackers:
            t.start()
        time.sleep(1.0)
        during: list[float] = []
        errors: list[str] = []
        caller = threading.Thread(target=normal_calls, args=(socket, ids, stop, during, errors), daemon=True)
        caller.start()
        time.sleep(args.seconds / 2)
        registrations = kubelet.registrations(RESOURCE)
        restarted = time.perf_counter()
        kubelet.restart()
        try:
            kubelet.wait_for_registrations(RESOURCE, registrations + 1, 30)
            reregistered = f"{(time.perf_counter() - restarted) * 1000:.0f} ms"
        except TimeoutError:
            reregistered = "no (30 s)"
        time.sleep(max(0.0, args.seconds / 2 - (time.perf_counter() - restarted)))
        stop.set()
        for t in [*attackers, caller]:
            t.join(DEADLINE_S * 3)
        sampler.done.set()
        time.sleep(3.0)
        after = proc_counts(proc.pid)
        calls_s = len(during) / args.seconds
        rows = [
            ["normal admissions before the attack", len(base), ms(percentile(base, 50)), ms(percentile(base, 99)),
             len(base_errors)],
            ["normal admissions during the attack", len(during), ms(percentile(during, 50)),
             ms(percentile(during, 99)), f"{len(errors)} ({', '.join(sorted(set(errors))) or 'none'})"],
        ]
        table = markdown_table(["calls", "count", "p50 ms", "p99 ms", "errors"], rows)
        proc_table = markdown_table(
            ["plugin process", "before", "peak during", "after (3 s)"],
            [["open fds", before[0], sampler.peak[0], after[0]], ["threads", before[1], sampler.peak[1], after[1]]])
        text = f"""# ListAndWatch attack on the device plugin ({args.label})

`python -m bench.attack_plugin --label {args.label}` on {machine_line()}. {args.attackers} attackers each open
{args.streams} ListAndWatch streams, hold them {args.hold} s, drop them, again, for {args.seconds:.0f} s
({stats['opened']} streams opened, {stats['refused']} seen refused with RESOURCE_EXHAUSTED); meanwhile one caller
makes admissions (GetPreferredAllocation of 4 then Allocate, 5 s deadline each) in a closed loop
({calls_s:.1f}/s during the attack); halfway through, the kubelet restarts.

{table}

Re-registration after the kubelet restart, during the attack: {reregistered}.

{proc_table}
"""
        print(text)
        if not args.no_write:
            RESULTS.mkdir(parents=True, exist_ok=True)
            (RESULTS / f"attack-plugin-{args.label}.md").write_text(text)
            print(f"wrote {RESULTS / f'attack-plugin-{args.label}.md'}")
    finally:
        stop_process(proc, 10)
        kubelet.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
