"""The plugin killed during Allocate: `python -m bench.plugin_crash [--kills 20] [--terms 10] [--burners 2]
[--seed 1] [--out bench/results/plugin-crash]`.

Through etcd and kube-apiserver v1.36.2 (tests/helpers/controlplane.py), one simulated DGX-1 node: the real
`gpuplugin run` process, the kubelet simulator admitting the pods bound to the node from the apiserver
(sim.admission), the kubelet's PodResources. Each round binds 4 pods of 2 GPUs, each with an extender plan (the
plans fill the node), and signals the plugin after the kubelet starts the round's k-th Allocate call (k random in
1..4): every other point a random 0-4 ms later (before the call reaches the plugin, while it is in flight, or just
after, as the timing falls), the others frozen (SIGSTOP as the call starts, the signal and SIGCONT 5-50 ms later:
the call surely in flight). SIGKILL rounds first, then SIGTERM rounds. The plugin is started again as soon as it
has exited (the DaemonSet's container restart, without the crash-loop backoff). A pod whose admission failed (its
Allocate cut, or no healthy devices while the plugin was away) ends Failed as the real kubelet leaves it, and is
made again under its name with its plan once the plugin is back, as its owner would
(tests/reliability/plugin_crash.py). Per round: device ids held by two pods, pods never admitted (stranded), the
Node's published used GPUs against PodResources, pods whose planned GPUs were free at admission but that got others,
and the time from the new process's start to the kubelet accepting its registration, and to every device Healthy
again. Under `--burners` CPU burners (bench.common.burning).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import time
from pathlib import Path

from bench.common import RESULTS, burning, machine_line, markdown_table, percentile
from tests.helpers.controlplane import ControlPlane, skip_reason
from tests.reliability.plugin_crash import WAIT, KillPoint, RoundResult, crash_node, run_round


def kill_points(kills: int, terms: int, seed: int) -> list[KillPoint]:
    """Half of each signal's points frozen (the call surely in flight), half timed (wherever the delay falls)."""
    rng = random.Random(seed)
    points = []
    for sig, n in ((signal.SIGKILL, kills), (signal.SIGTERM, terms)):
        for i in range(n):
            frozen = i % 2 == 1
            delay = rng.uniform(0.005, 0.05) if frozen else rng.uniform(0.0, 0.004)
            points.append(KillPoint(rng.randint(1, 4), delay, sig, frozen=frozen))
    return points


def summary(results: list[RoundResult]) -> dict[str, object]:
    reg = [r.registration_s for r in results if r.registration_s is not None]
    dev = [r.devices_s for r in results if r.devices_s is not None]
    return {
        "rounds": len(results), "signalled": sum(r.killed for r in results),
        "sigkill": sum(r.point.sig is signal.SIGKILL for r in results),
        "sigterm": sum(r.point.sig is signal.SIGTERM for r in results),
        "frozen_in_flight": sum(r.point.frozen for r in results),
        "rounds_ok": sum(r.ok for r in results),
        "allocate_cut": sum(r.allocate_cut for r in results),
        "pods_failed_and_replaced": sum(r.cut_pods for r in results),
        "gpus_given_twice": sum(len(r.double_given) for r in results),
        "stranded_pods": sum(len(r.stranded) for r in results),
        "state_mismatches": sum(bool(r.state_mismatch) for r in results),
        "plan_violations": sum(len(r.plan_violations) for r in results),
        "registration_p50_s": percentile(reg, 50), "registration_p99_s": percentile(reg, 99),
        "registration_max_s": max(reg, default=float("nan")),
        "devices_p50_s": percentile(dev, 50), "devices_p99_s": percentile(dev, 99),
        "missed_registrations": len(results) - len(reg),
    }


def render(s: dict[str, object], command: str, burners: int) -> str:
    rows = [[k, f"{v:.3f}" if isinstance(v, float) else v] for k, v in s.items()]
    return (f"# Plugin killed during Allocate\n\n`{command}`\n\n{machine_line()}; {burners} CPU burners; "
            f"etcd + kube-apiserver v1.36.2, one DGX-1 node (8 GPUs), 4 pods x 2 GPUs with plans per round.\n\n"
            + markdown_table(["figure", "value"], rows)
            + "\n\nregistration: new process start -> the kubelet accepted its registration; devices: -> all 8 "
              "Healthy in the kubelet again (p99 of fewer than 100 rounds is their max). allocate_cut: pods whose "
              "Allocate call failed under the signal; pods_failed_and_replaced also counts pods that met no plugin. "
              "Figures include the simulator and the control plane on the same machine.\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=20, help="SIGKILL rounds")
    ap.add_argument("--terms", type=int, default=10, help="SIGTERM rounds")
    ap.add_argument("--burners", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS / "plugin-crash")
    args = ap.parse_args()
    if (why := skip_reason()) is not None:
        sys.exit(f"bench.plugin_crash: {why}")
    command = "python -m bench.plugin_crash " + " ".join(sys.argv[1:])
    results: list[RoundResult] = []
    with ControlPlane() as cp, crash_node(cp, "crash-dgx1", "plugin-crash") as node, burning(args.burners):
        started = node.start_plugin()
        if node.wait_registered(started, WAIT)[1] is None:
            sys.exit(f"bench.plugin_crash: the plugin never registered\n{node.log_tail()}")
        for i, point in enumerate(kill_points(args.kills, args.terms, args.seed)):
            t0 = time.monotonic()
            result = run_round(node, i, point)
            results.append(result)
            print(json.dumps({**result.as_dict(), "ok": result.ok, "round_s": round(time.monotonic() - t0, 2)}),
                  flush=True)
            if not result.ok:
                print(node.log_tail(3000), file=sys.stderr)
    s = summary(results)
    text = render(s, command, args.burners)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"command": command, "burners": args.burners, "machine": machine_line(), "summary": s,
         "rounds": [{**r.as_dict(), "ok": r.ok} for r in results]}, indent=1) + "\n")


if __name__ == "__main__":
    main()
