"""The MPS control DaemonSet on a real GPU: `python -m bench.mps_daemonset --out FILE.json` on a GPU machine (the lent
H200), then `python -m bench.mps_daemonset --report FILE.json` anywhere, which writes bench/results/mps_daemonset.md.

Why: the chart runs the MPS control daemons in a DaemonSet of their own (`gpuplugin mps-control`) so that a plugin
pod restart leaves MPS clients their server. The tests prove it with the control-protocol stand-in; this proves it
with the real `nvidia-cuda-mps-control` and a real CUDA client. Two real processes, as on a node: `gpuplugin run`
(live NVML, GPU 0 shared as MPS replicas, `--mps-daemons external`, registered with the kubelet simulator) and
`gpuplugin mps-control` on the same root. The client is started with the environment the plugin's Allocate returned
for one replica and computes (checking every result) while:
1. the plugin is SIGKILLed (its container ends) and started again: the daemon and the client's server must be the
   same processes, the replicas healthy again, the client's results right;
2. the control process is stopped and started again: it must adopt the daemon, not start a second one.
Last, the daemon is quit through the control pipe and the root left as the test found it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import RESULTS, markdown_table
from bench.mps_client import client_result, start_client
from bench.mps_processes import control_pid, mps_processes

RESOURCE = "nvidia.com/gpu.shared"
REPLICAS = 4
CONFIG = ("version: v1\nsharing:\n  mps:\n    renameByDefault: true\n    resources:\n"
          f"    - {{name: nvidia.com/gpu, replicas: {REPLICAS}, devices: [0]}}\n")
WAIT_S = 60.0


def _wait(what: str, check: Callable[[], bool], timeout_s: float = WAIT_S) -> float:
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout_s:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.1)
    return round(time.monotonic() - t0, 2)


def _pid(pipe: Path) -> int | None:
    try:
        return int((pipe / "nvidia-cuda-mps-control.pid").read_text())
    except (OSError, ValueError):
        return None


def _servers() -> list[str]:
    return [p for p in mps_processes() if "nvidia-cuda-mps-server" in p]


def measure(out: Path, root: Path) -> None:
    from gputopo.contract import replica_id
    from sim.kubelet import KubeletSimulator
    from tests.fakes.kubelet_podresources import PodResourcesServer

    configs = root / "configs"
    configs.mkdir(parents=True)
    (configs / "mps").write_text(CONFIG)
    mps_root = root / "mps"
    pipe = mps_root / RESOURCE / "pipe"
    logs = {"plugin": root / "plugin.log", "control": root / "control.log"}
    data: dict[str, Any] = {"steps": {}}
    steps = data["steps"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    plugin_argv = [sys.executable, "-m", "gpuplugin.cli", "run", "--device-plugin-dir", str(root / "dp"),
                   "--pod-resources-socket", str(root / "podres.sock"), "--metrics-port", "0", "--no-publish",
                   "--sharing-config-dir", str(configs), "--sharing-config-default", "mps",
                   "--mps-root", str(mps_root), "--mps-daemons", "external", "--mps-probe-interval", "0.5"]
    control_argv = [sys.executable, "-m", "gpuplugin.cli", "mps-control", "--mps-root", str(mps_root),
                    "--poll-interval", "0.5", "--probe-interval", "0.5", "--metrics-port", "0"]

    def start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
        with open(log, "ab") as f:
            return subprocess.Popen(argv, env=env, stdout=f, stderr=subprocess.STDOUT)

    def save() -> None:
        data["logs"] = {k: v.read_text(errors="replace")[-6000:] for k, v in logs.items() if v.exists()}
        out.write_text(json.dumps(data, indent=1))

    procs: list[subprocess.Popen[bytes]] = []
    with PodResourcesServer(str(root / "podres.sock")) as podres, KubeletSimulator(root / "dp") as kubelet:
        try:
            plugin = start(plugin_argv, logs["plugin"])
            control = start(control_argv, logs["control"])
            procs += [plugin, control]

            def healthy() -> bool:
                ds = kubelet.devices(RESOURCE)
                return len(ds) == REPLICAS and all(d.healthy for d in ds)

            steps["first_healthy_s"] = _wait("the replicas healthy (the control process's daemon answering)", healthy)
            daemon = _pid(pipe)
            steps["daemon"] = {"pid": daemon, "by_env": control_pid(pipe), "processes": mps_processes()}
            held = [replica_id(kubelet.devices(RESOURCE)[0].id.split("::")[0], 0)]
            reply = kubelet.allocate(RESOURCE, held)
            envs = dict(reply.envs)
            data["allocate_env"] = {k: v for k, v in envs.items() if k.startswith(("CUDA_MPS", "NVIDIA_VISIBLE"))}
            podres.service.set_pod("default", "infer", {"main": {RESOURCE: held}})
            holder = start_client(envs, cap_mib=0, hold_s=25.0)
            assert holder.stdout is not None
            steps["client_ready"] = holder.stdout.readline().strip()
            steps["servers_with_client"] = _servers()
            save()

            # 1. the plugin's container ends without a word, and the DaemonSet starts the next pod
            plugin.send_signal(signal.SIGKILL)
            plugin.wait(10)
            steps["plugin_killed"] = {"daemon_pid": _pid(pipe), "servers": _servers(),
                                      "unhealthy_after_s": _wait("the kubelet to see the plugin gone",
                                                                 lambda: not healthy())}
            plugin = start(plugin_argv, logs["plugin"])
            procs.append(plugin)
            steps["plugin_restarted"] = {"healthy_after_s": _wait("the restarted plugin's replicas healthy", healthy),
                                         "daemon_pid": _pid(pipe), "servers": _servers()}
            save()

            # 2. the control pod restarts (SIGTERM, as on a pod deletion): the next one adopts the daemon
            control.send_signal(signal.SIGTERM)
            control.wait(20)
            steps["control_stopped"] = {"daemon_pid": _pid(pipe), "alive": control_pid(pipe) is not None,
                                        "servers": _servers()}
            control = start(control_argv, logs["control"])
            procs.append(control)
            time.sleep(3.0)
            steps["control_restarted"] = {"daemon_pid": _pid(pipe), "servers": _servers(), "healthy": healthy()}
            steps["client"] = client_result(holder)
            steps["starts_logged"] = logs["control"].read_text(errors="replace").count("plugin.mps.started")
            save()
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(20)
                if p.poll() is None:
                    p.kill()
            if pipe.exists():
                subprocess.run(["nvidia-cuda-mps-control"], input="quit\n", text=True, timeout=20, check=False,
                               env={**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}, capture_output=True)
            with contextlib.suppress(SystemExit):
                _wait("the daemon to quit", lambda: control_pid(pipe) is None, 20.0)
            data["left_after_quit"] = mps_processes()
            save()


def report(path: Path) -> None:
    d = json.loads(path.read_text())
    s = d["steps"]
    first = s["daemon"]["pid"]

    def servers(step: dict[str, Any]) -> str:
        return ", ".join(x.split()[0] for x in step["servers"]) or "none"

    rows = [
        ["started: replicas healthy, client connected", f"{s['first_healthy_s']} s", first,
         ", ".join(x.split()[0] for x in s["servers_with_client"]) or "none"],
        ["plugin SIGKILLed", f"unhealthy after {s['plugin_killed']['unhealthy_after_s']} s",
         s["plugin_killed"]["daemon_pid"], servers(s["plugin_killed"])],
        ["plugin started again", f"healthy after {s['plugin_restarted']['healthy_after_s']} s",
         s["plugin_restarted"]["daemon_pid"], servers(s["plugin_restarted"])],
        ["control process stopped", "-", s["control_stopped"]["daemon_pid"], servers(s["control_stopped"])],
        ["control process started again", f"healthy: {s['control_restarted']['healthy']}",
         s["control_restarted"]["daemon_pid"], servers(s["control_restarted"])],
    ]
    c = s["client"]
    lines = [
        "# The MPS control DaemonSet on the real H200 (`python -m bench.mps_daemonset`)",
        "",
        f"`gpuplugin run --mps-daemons external` (live NVML, GPU 0 as {REPLICAS} MPS replicas, the kubelet simulator)",
        "and `gpuplugin mps-control` on one root, with the real `nvidia-cuda-mps-control`; one CUDA client started",
        "with the env the plugin's Allocate returned for one replica, computing (and checking every bf16 matmul's",
        "result) for 25 s while the plugin was SIGKILLed and started again, then the control process stopped and",
        "started again. Written by `python -m bench.mps_daemonset --report FILE.json`.",
        "",
        markdown_table(["step", "replicas", "control daemon pid", "MPS server pids"], rows),
        "",
        f"- Allocate's env: `{json.dumps(d['allocate_env'])}`",
        f"- client: rc {c.get('rc')}, {c.get('hold_iters')} checked matmuls, {c.get('hold_wrong')} wrong, "
        f"{c.get('sms')} SMs seen",
        f"- daemon starts logged by the control processes: {s['starts_logged']} (adoptions are not starts)",
        f"- MPS processes left after the final quit: {d['left_after_quit'] or 'none'}",
        "",
    ]
    (RESULTS / "mps_daemonset.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="where the measurement's JSON goes (on the GPU machine)")
    p.add_argument("--report", type=Path, help="write bench/results/mps_daemonset.md from this JSON")
    a = p.parse_args()
    if a.report:
        report(a.report)
    elif a.out:
        with tempfile.TemporaryDirectory(prefix="mpsds-", dir="/tmp") as tmp:
            measure(a.out, Path(tmp))
    else:
        p.error("--out or --report")


if __name__ == "__main__":
    main()
