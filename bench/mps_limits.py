"""MPS limits and daemon lifetime on a real GPU: `python -m bench.mps_limits` on a GPU machine (the lent H200),
then `python -m bench.mps_limits --report FILE.json` anywhere, which writes bench/results/mps_limits.md.

Limits: the plugin's own path (NVML discovery, a SharedResourceManager over GPU 0 cut in REPLICAS MPS replicas,
GetPreferredAllocation and Allocate for one replica, the plugin's MpsDaemon running the real
`nvidia-cuda-mps-control -d` with its pipe and log directories under a fresh root) gives a client environment with
CUDA_MPS_PINNED_DEVICE_MEM_LIMIT (memory / replicas) and CUDA_MPS_ACTIVE_THREAD_PERCENTAGE (100 / replicas). Each
case starts one client process (bench.mps_client) with that environment (or a variation of it, named in the case)
and records what the client sees: the multiprocessors CUDA reports, a bf16 matrix product's TFLOP/s, and how much
device memory it can take in 512 MiB cudaMallocs before the first one fails, against its limit. The reference case
runs with no MPS at all (the whole GPU).

Lifetime: the same daemon is watched by one MpsDaemon runner (the plugin), which is stopped while a client holds
a replica and computes; a second runner (the restarted plugin) must adopt the daemon (same pid, no second start)
and the client must finish its work untouched. Last, the control daemon is killed (SIGKILL, a crash): the runner
must see it silent, mark the replicas unhealthy and start a new one. What the pipe directory holds at each step is
recorded, so the CI stand-in (tests/helpers/mps_control.py) can be checked against the real daemon's files.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, markdown_table
from bench.mps_client import STEP_MIB, client_result, start_client
from bench.mps_processes import control_pid, end_leftovers, mps_processes
from bench.sharing import RESOURCE, quit_and_wait, until_answering

REPLICAS = 4


# -- the driver ---------------------------------------------------------------------------------------------------


def _listing(path: Path) -> list[str]:
    """Names and kinds in a directory (socket, file, dir), to compare with the CI stand-in's."""
    if not path.is_dir():
        return []
    kinds = {True: "socket"}
    return sorted(f"{p.name} ({kinds.get(p.is_socket(), 'dir' if p.is_dir() else 'file')})" for p in path.iterdir())


def _state(daemon: Any) -> dict[str, Any]:
    s = daemon.probe()
    return {"answers": s.answers, "pid": s.pid, "alive": s.alive, "servers": list(s.servers or ()),
            "socket": s.socket, "pipe": _listing(daemon.share.pipe_dir)}


def measure(out: Path, root: Path) -> None:
    from gpuplugin.sharing.layout import SharedSet
    from gpuplugin.sharing.manager import SharedResourceManager
    from gpuplugin.sharing.mps import MEMORY_ENV, PIPE_ENV, THREADS_ENV, MpsDaemon, MpsGpu, MpsShare
    from gputopo.discovery.nvml import discover_node
    from gputopo.discovery.nvml_backend import LiveNvmlBackend

    backend = LiveNvmlBackend()
    backend.init()
    node = discover_node(backend)
    topo = node.topology
    gpu = topo.gpus[0]
    share = MpsShare(RESOURCE, root, (MpsGpu(gpu.id, REPLICAS, gpu.memory_mib),))
    minors = {i: d.minor for i, d in enumerate(node.devices) if d.minor is not None}
    manager = SharedResourceManager(topo, SharedSet(RESOURCE, "mps", True, True, ((0, REPLICAS),)), mps=share,
                                    minors=minors)
    health: list[bool] = []
    data: dict[str, Any] = {"gpu": gpu.model, "memory_mib": gpu.memory_mib, "replicas": REPLICAS, "cases": [],
                            "lifetime": {}}
    life = data["lifetime"]

    def save() -> None:
        out.write_text(json.dumps(data, indent=1))

    plugin = MpsDaemon(share, lambda ok: (health.append(ok), manager.set_service_health(ok)), interval_s=1.0)
    life["before_start"] = _state(plugin)
    life["mps_processes_before"] = mps_processes()
    until_answering(plugin)
    life["started"] = {**_state(plugin), "starts": plugin.starts, "log": _listing(share.log_dir),
                       "processes": mps_processes(), "control_pid_by_env": control_pid(share.pipe_dir)}
    cpid = life["started"]["pid"] or life["started"]["control_pid_by_env"]
    if cpid:
        life["started"]["session"] = {"daemon_sid": os.getsid(cpid), "daemon_pgid": os.getpgid(cpid),
                                      "plugin_sid": os.getsid(0), "plugin_pgid": os.getpgid(0)}
    free = [s.device.id for s in manager.snapshot() if s.healthy]
    alloc = manager.allocate(list(manager.preferred(free, [], 1).ids))
    envs = dict(alloc.envs)
    data["allocate_env"] = envs
    limit = int(envs[MEMORY_ENV].split("=")[1].rstrip("M"))
    default_threads = plugin.send("get_default_active_thread_percentage")
    data["daemon_defaults"] = {"threads": default_threads,
                               "pinned_mem": plugin.send("get_default_device_pinned_mem_limit 0")}
    save()
    try:
        # -- lifetime: a client holds a replica across a plugin stop and a restarted plugin's adoption ---------
        holder = start_client(envs, cap_mib=0, hold_s=12.0)
        assert holder.stdout is not None
        life["holder_ready"] = holder.stdout.readline().strip()
        life["with_client"] = {**_state(plugin), "processes": mps_processes()}
        plugin.stop()  # the plugin stops (SIGTERM, upgrade): it must leave the daemon to its clients
        life["after_plugin_stop"] = _state(plugin)
        restarted = MpsDaemon(share, lambda ok: health.append(ok), interval_s=1.0)
        restarted.step()
        life["restarted_plugin"] = {**_state(restarted), "adopted": restarted.adopted, "starts": restarted.starts,
                                    "healthy": restarted.healthy}
        life["holder"] = client_result(holder)
        save()

        # -- limits: one client at a time, each with the Allocate environment or a variation of it ------------
        others = {k: v for k, v in envs.items() if k not in (MEMORY_ENV, THREADS_ENV)}
        cases = [
            ("Allocate's env (1 of 4 replicas)", envs, limit),
            ("client limits lowered: 8192M, 12%", envs | {MEMORY_ENV: "0=8192M", THREADS_ENV: "12"}, 8192),
            ("no client limits (daemon defaults only)", others, limit),
            ("client asks above the daemon default: 2x memory, 50%",
             envs | {MEMORY_ENV: f"0={2 * limit}M", THREADS_ENV: "50"}, 2 * limit),
            ("no MPS (whole GPU, reference)", {PIPE_ENV: str(root / "none")}, limit),
        ]
        (root / "none").mkdir(exist_ok=True)
        for name, env, expect in cases:
            cap = int(expect * 1.25) + STEP_MIB
            r = client_result(start_client(env, cap))
            data["cases"].append({"case": name, "env": {k: v for k, v in env.items() if k.startswith("CUDA_MPS")},
                                  "expected_limit_mib": expect, "cap_mib": cap, **r})
            print(json.dumps(data["cases"][-1]), flush=True)
            save()

        # -- a crash: the control daemon is killed; the runner must restart it, replicas unhealthy meanwhile ----
        pid = restarted.probe().pid or control_pid(share.pipe_dir)
        life["killed_pid"] = pid
        if pid:
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
        life["after_kill"] = _state(restarted)
        seen = len(health)
        t0 = time.monotonic()
        try:
            until_answering(restarted)
        except SystemExit as e:
            life["restart_failed"] = str(e)
        life["restarted_after_kill"] = {**_state(restarted), "starts": restarted.starts,
                                        "health_changes": health[seen:],
                                        "seconds_to_answer": round(time.monotonic() - t0, 2)}
        life["mps_servers_running"] = mps_processes()
        save()
        quit_and_wait(restarted)
        life["after_quit"] = _state(restarted)
        life["left_after_quit"] = end_leftovers(share.pipe_dir)
        save()
    finally:
        plugin.quit()  # the uninstall path: idempotent if it already ended
        manager.close()
        backend.shutdown()


# -- the report ---------------------------------------------------------------------------------------------------


def report(path: Path) -> None:
    data = json.loads(path.read_text())
    ref = next((c for c in data["cases"] if c["case"].startswith("no MPS")), None)
    rows = []
    for c in data["cases"]:
        share = f"{c['tflops'] / ref['tflops']:.2f}" if ref and c.get("tflops") and ref.get("tflops") else "-"
        rows.append([c["case"], ", ".join(f"{k}={v}" for k, v in c["env"].items() if k != "CUDA_MPS_PIPE_DIRECTORY")
                     or "-", c.get("sms", "-"), c.get("tflops", "-"), share, c["expected_limit_mib"],
                     c.get("took_mib", "-"), "yes" if c.get("failed") else f"no (stopped at cap {c['cap_mib']})",
                     c.get("free_mib", "-")])
    life = data["lifetime"]
    text = "\n".join([
        "# MPS on a real GPU: the per-client limits Allocate returns, and the daemon across a plugin restart",
        "",
        f"Measured with `python -m bench.mps_limits` on the lent {data['gpu']} ({data['memory_mib']} MiB), report by "
        f"`python -m bench.mps_limits --report {path}`. GPU 0 cut in {data['replicas']} MPS replicas; the daemon "
        f"(real `nvidia-cuda-mps-control`) was started by the plugin's MpsDaemon and set its defaults: "
        f"`{json.dumps(data['daemon_defaults'])}`. Allocate's environment for one replica: "
        f"`{json.dumps({k: v for k, v in data['allocate_env'].items() if k.startswith('CUDA_MPS')})}`.",
        "",
        "## Limits",
        "",
        f"One client process per row. It reports the multiprocessors CUDA shows it, a bf16 8192^3 matrix "
        f"product's TFLOP/s (and its share of the no-MPS reference), then takes device memory in {STEP_MIB} MiB "
        "cudaMallocs until one fails (or a cap of 1.25x the expected limit is reached).",
        "",
        markdown_table(["case", "client env", "SMs", "TFLOP/s", "share", "expected limit MiB", "took MiB",
                        "allocation failed", "free MiB at start (mem_get_info)"], rows),
        "",
        *_findings(data),
        "",
        "## Daemon lifetime",
        "",
        f"- started by the plugin's runner: starts={life.get('started', {}).get('starts')}, pid "
        f"{life.get('started', {}).get('pid')}; pipe directory `{life.get('started', {}).get('pipe')}`, "
        f"log directory `{life.get('started', {}).get('log')}`",
        f"- the daemon's session: `{json.dumps(life.get('started', {}).get('session'))}` (it leads a session of "
        "its own, apart from the plugin's process group)",
        f"- a client holding a replica: servers {life.get('with_client', {}).get('servers')}",
        f"- plugin stopped while it computes: daemon answers={life.get('after_plugin_stop', {}).get('answers')}, "
        f"pid {life.get('after_plugin_stop', {}).get('pid')}",
        f"- a new runner (the restarted plugin): adopted={life.get('restarted_plugin', {}).get('adopted')}, "
        f"starts={life.get('restarted_plugin', {}).get('starts')}, pid {life.get('restarted_plugin', {}).get('pid')}, "
        f"servers {life.get('restarted_plugin', {}).get('servers')}",
        f"- the client: `{json.dumps(life.get('holder'))}` (hold_wrong: products that changed; rc 0: it ended "
        "normally)",
        f"- control daemon killed (SIGKILL): state `{json.dumps(life.get('after_kill'))}`",
        f"- then: `{json.dumps(life.get('restarted_after_kill'))}`; MPS processes left: "
        f"{life.get('mps_servers_running')}",
        f"- after quit: `{json.dumps(life.get('after_quit'))}`",
        "",
    ])
    (RESULTS / "mps_limits.md").write_text(text)
    print(text)


def _findings(data: dict[str, Any]) -> list[str]:
    """What the rows show, worded from the figures (so a rerun that shows otherwise says otherwise)."""
    cases = {c["case"]: c for c in data["cases"]}
    out = []
    a = cases.get("Allocate's env (1 of 4 replicas)")
    ref = next((c for c in data["cases"] if c["case"].startswith("no MPS")), None)
    if a and ref:
        out.append(f"- Allocate's env: {a['took_mib']} MiB taken, the next {STEP_MIB} MiB "
                   f"{'refused' if a['failed'] else 'granted'} against a limit of {a['expected_limit_mib']} MiB "
                   f"(within: granted; over: refused); without MPS the same client took {ref['took_mib']} MiB "
                   f"{'and was refused' if ref['failed'] else 'and was never refused'}. Compute: {a['sms']} of "
                   f"{ref['sms']} SMs, {a['tflops'] / ref['tflops']:.2f} of the whole GPU's TFLOP/s for "
                   f"{a['env'].get('CUDA_MPS_ACTIVE_THREAD_PERCENTAGE')}%.")
    low = cases.get("client limits lowered: 8192M, 12%")
    if low:
        out.append(f"- a client's env lowers the daemon's defaults: 8192M, 12% gave {low['took_mib']} MiB "
                   f"(refused beyond: {low['failed']}) and {low['sms']} SMs.")
    high = cases.get("client asks above the daemon default: 2x memory, 50%")
    if high and a:
        raised = high["took_mib"] > a["took_mib"] or high["sms"] > a["sms"]
        out.append(f"- a client's env {'raises' if raised else 'cannot raise'} them: asking 2x memory and 50% gave "
                   f"{high['took_mib']} MiB and {high['sms']} SMs, as the daemon's defaults.")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", type=Path, help="write bench/results/mps_limits.md from this JSON")
    ap.add_argument("--out", type=Path, default=Path("mps_limits.json"), help="where the measured JSON goes")
    ap.add_argument("--mps-root", type=Path, default=Path("/tmp/mps-limits"),
                    help="MPS root: <root>/nvidia.com/gpu/{pipe,log}")
    args = ap.parse_args()
    if args.report:
        report(args.report)
    else:
        args.mps_root.mkdir(parents=True, exist_ok=True)
        measure(args.out, args.mps_root)


if __name__ == "__main__":
    main()
