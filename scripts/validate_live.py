"""Run `gpuplugin run` with live NVML against the kubelet simulator and print what a kubelet would see.

    python scripts/validate_live.py [--sizes 1,2,4,8] [--topology FILE]

On a GPU machine: starts the kubelet simulator in a temporary device plugin directory, starts the real plugin
process (live NVML unless --topology), waits for registration and the ListAndWatch list, asks
GetPreferredAllocation for every size and Allocate for the answer, prints each exchange, then stops the plugin
with SIGTERM and checks that its socket is gone. Exit status 0 only when every step worked.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sim.kubelet import KubeletSimulator  # noqa: E402

RESOURCE = "nvidia.com/gpu"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--topology", default=None)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()
    plugin_dir = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))
    ok = True
    with KubeletSimulator(plugin_dir) as kubelet:
        cmd = [sys.executable, "-m", "gpuplugin.cli", "run", "--device-plugin-dir", str(plugin_dir),
               "--metrics-port", "0", "--no-publish"]
        if args.topology:
            cmd += ["--topology", args.topology]
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        plugin = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            t0 = time.monotonic()
            kubelet.wait_for_registrations(RESOURCE, 1, timeout=args.timeout)
            print(f"registered after {time.monotonic() - t0:.2f} s; options {kubelet.options(RESOURCE)}".strip())
            deadline = time.monotonic() + args.timeout
            while not kubelet.devices(RESOURCE) and time.monotonic() < deadline:
                time.sleep(0.05)
            devices = kubelet.devices(RESOURCE)
            print(f"ListAndWatch: {len(devices)} devices")
            for d in devices:
                print(f"  {d}")
            ok &= bool(devices) and all(d.healthy for d in devices)
            ids = [d.id for d in devices]
            for size in [int(s) for s in args.sizes.split(",")]:
                if size > len(ids):
                    print(f"size {size}: skipped ({len(ids)} GPUs)")
                    continue
                raw = kubelet.preferred_raw(RESOURCE, ids, [], size)
                chosen = kubelet.preferred(RESOURCE, ids, [], size)
                resp = kubelet.allocate(RESOURCE, chosen)
                print(f"size {size}: GetPreferredAllocation -> {raw}")
                print(f"         Allocate envs={dict(resp.envs)} annotations={dict(resp.annotations)}")
                nodes, cdi = [d.host_path for d in resp.devices], [c.name for c in resp.cdi_devices]
                print(f"         devices={nodes} cdi={cdi}")
                ok &= len(raw) == size
        finally:
            plugin.send_signal(signal.SIGTERM)
            try:
                out, _ = plugin.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                plugin.kill()
                out, _ = plugin.communicate()
            print(f"plugin exited with {plugin.returncode}; its log:")
            print("\n".join("  " + line for line in out.splitlines()[-40:]))
            leftovers = [p.name for p in plugin_dir.iterdir() if p.name != "kubelet.sock"]
            print(f"sockets left besides kubelet.sock: {leftovers}")
            ok &= plugin.returncode == 0 and not leftovers
    print("RESULT:", "OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
