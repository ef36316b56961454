"""Device plugin gRPC fuzzing at scale: `python -m bench.fuzz_plugin [--cases 20000] [--seed 1]`, written to
bench/results/fuzz-plugin.md.

The fuzzer and its oracle are tests/reliability/grpc_fuzz.py (the CI test runs a few thousand cases of the same):
raw bytes to every method path, hypothesis-made GetPreferredAllocation and Allocate messages with hostile content
(unicode, empty, huge and repeated ids, thousands of ids, any int32 size, must-include outside available), and four
enormous requests. Two plugins in this process, each registered with a kubelet simulator: a DGX-1 (8 GPUs, UUID
ids) and a 16-GPU NVSwitch node (index ids), one GPU unhealthy on each.

Printed and written: cases executed, RPC status counts per method, protocol violations and crashes (target 0 for
both), per-method call time (p50, p99, max) and the longest call. Plugin logs are produced at warning level, as in
production, and counted rather than shown.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import time
from collections.abc import Callable

from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from bench.common import RESULTS, SHARED, machine_line, markdown_table, percentile
from gpuplugin.proto import deviceplugin_pb2 as pb
from gputopo.core import Topology
from gputopo.discovery.loader import load_topology_file
from gputopo.logs import configure_logging
from sim.machines import nvswitch_node
from tests.reliability import grpc_fuzz as fz
from tests.reliability.strategies import allocate_requests, preferred_requests

CHECK_EVERY = 250  # cases between liveness checks


class CountingSink(io.TextIOBase):
    """Where the plugin's logs go during the run: counted, not kept."""

    def __init__(self) -> None:
        self.chars = 0
        self.lines = 0

    def write(self, s: str) -> int:
        self.chars += len(s)
        self.lines += s.count("\n")
        return len(s)

    def isatty(self) -> bool:
        return False


def structured(
    fuzzer: fz.PluginFuzzer, strategy: st.SearchStrategy, method: fz.Method, examples: int, run_seed: int
) -> None:
    """`examples` hypothesis-made messages sent to `method`; generation only (a broken promise is recorded, not
    raised, so the run goes on and counts)."""
    sent = [0]

    @seed(run_seed)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def case(message: pb.PreferredAllocationRequest | pb.AllocateRequest) -> None:
        fuzzer.send_message(method, message)
        sent[0] += 1
        if sent[0] % CHECK_EVERY == 0:
            fuzzer.alive()

    case()
    fuzzer.alive()


def targets() -> list[tuple[str, Callable[[], Topology], str]]:
    return [
        ("DGX-1 V100 (8 GPUs, uuid ids)", lambda: load_topology_file(SHARED / "topologies" / "dgx1-v100-ucxpy.txt"),
         "uuid"),
        ("DGX-2-like NVSwitch (16 GPUs, index ids)", lambda: nvswitch_node(16, 6, 2), "index"),
    ]


def run(cases: int, run_seed: int) -> tuple[fz.FuzzStats, list[list[object]], list[str], float]:
    """Returns the merged stats, one row per target, harm found after each target, and wall seconds."""
    total = fz.FuzzStats()
    rows: list[list[object]] = []
    harms: list[str] = []
    start = time.perf_counter()
    share = cases // len(targets())
    for k, (name, make, id_strategy) in enumerate(targets()):
        stats = fz.FuzzStats()
        raw = share * 70 // 100
        each = (share - raw - 4) // 2
        t0 = time.perf_counter()
        with fz.fuzz_target(make(), stats, id_strategy=id_strategy) as target:
            ids = sorted(target.fuzzer.known)
            fz.fuzz_raw(target.fuzzer, random.Random(run_seed * 100 + k), raw, CHECK_EVERY)
            structured(target.fuzzer, preferred_requests(ids), fz.PREFERRED, each, run_seed * 100 + k)
            structured(target.fuzzer, allocate_requests(ids), fz.ALLOCATE, each, run_seed * 100 + k + 50)
            fz.enormous_cases(target.fuzzer)
            harm = target.harm()
        if harm is not None:
            harms.append(f"{name}: {harm}")
            stats.crashes += 1
        seconds = time.perf_counter() - t0
        rows.append([name, stats.cases, raw, each, each, 4, len(stats.violations), stats.crashes, f"{seconds:.1f}"])
        print(f"{name}: {fz.summary(stats)}", flush=True)
        total.merge(stats)
    return total, rows, harms, time.perf_counter() - start


def status_rows(stats: fz.FuzzStats) -> list[list[object]]:
    rows: list[list[object]] = []
    for method in fz.METHODS:
        codes = {code: n for (name, code), n in stats.statuses.items() if name == method.name}
        values = stats.seconds.get(method.name, [])
        rows.append([
            method.path,
            sum(codes.values()),
            ", ".join(f"{c} {n}" for c, n in sorted(codes.items(), key=lambda x: -x[1])),
            f"{percentile(values, 50) * 1000:.2f}" if values else "-",
            f"{percentile(values, 99) * 1000:.2f}" if values else "-",
            f"{max(values) * 1000:.1f}" if values else "-",
        ])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=20_000, help="total cases over both plugins [20000]")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-write", action="store_true", help="print only; leave bench/results alone")
    args = parser.parse_args()
    sink = CountingSink()
    configure_logging("warning", stream=sink)  # type: ignore[arg-type]
    load_before = os.getloadavg()
    stats, target_rows, harms, wall = run(args.cases, args.seed)
    load_after = os.getloadavg()
    status = status_rows(stats)

    print(fz.summary(stats))
    for row in status:
        print(" | ".join(str(c) for c in row))
    for v in stats.violations[:20]:
        print("VIOLATION", v[:400])
    for h in harms:
        print("HARM", h)
    load = ", ".join(f"{a:.1f} -> {b:.1f}" for a, b in zip(load_before, load_after, strict=True))
    text = f"""# Device plugin gRPC fuzzing

`python -m bench.fuzz_plugin --cases {args.cases} --seed {args.seed}` on {machine_line()}; {wall:.0f} s wall
({stats.cases / wall:.0f} cases/s). Fuzzer and client share the machine with the plugins (in-process, real gRPC
over unix sockets), so call times include the client's cost and any load from other work (load average 1/5/15 min,
start -> end: {load}).

Oracle (tests/reliability/grpc_fuzz.py): unparseable bodies get an error status; parseable ones answer per the
device plugin protocol: GetPreferredAllocation never an RPC error, always distinct ids from the container's
available ids, at most `size`, exactly `size` with every must-include id for a request the allocator can honour;
Allocate OK exactly for known, healthy, distinct ids, else INVALID_ARGUMENT with a message under
{fz.MAX_DETAILS} bytes; Register (not a plugin method) UNIMPLEMENTED; bodies over 4 MiB RESOURCE_EXHAUSTED.
A crash is the plugin not answering GetDevicePluginOptions (checked every {CHECK_EVERY} cases), or the
registered kubelet simulator seeing its stream disturbed or admission failing afterwards.

## Totals

| cases | protocol violations | crashes | longest call |
|---|---|---|---|
| {stats.cases} | {len(stats.violations)} | {stats.crashes} | {stats.slowest_s * 1000:.1f} ms ({stats.slowest_case}) |

Targets: 0 violations, 0 crashes. Plugin log output during the run: {sink.lines} lines, {sink.chars / 1e6:.1f} MB
(warning level).

## Per plugin

{markdown_table(["plugin", "cases", "raw bytes", "GetPreferredAllocation (hypothesis)", "Allocate (hypothesis)",
                 "enormous", "violations", "crashes", "seconds"], target_rows)}

## RPC status per method

{markdown_table(["method path", "calls", "statuses", "p50 ms", "p99 ms", "max ms"], status)}

UNKNOWN is grpc.aio's own answer to a body that does not parse (a DecodeError in its deserializer), before the
plugin's code runs. The enormous cases are 200,000-id Allocate and GetPreferredAllocation requests and a 5 MiB id.
"""
    if stats.violations or harms:
        text += "\n## Violations and harm (first 20)\n\n" + "\n".join(
            f"- {v[:300]}" for v in [*harms, *stats.violations][:20]
        ) + "\n"
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "fuzz-plugin.md").write_text(text)
        print(f"wrote {RESULTS / 'fuzz-plugin.md'}")


if __name__ == "__main__":
    main()
