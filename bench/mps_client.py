"""The CUDA client of the MPS benchmarks (bench.mps_limits, bench.mps_daemonset): one process started with a
replica's environment (what the plugin's Allocate returned, or a variation of it), reporting what CUDA lets it
have. A process of its own because MPS limits are read from the environment when the CUDA context is made.

`python -m bench.mps_client --cap-mib N [--hold-s S]` prints one JSON line: SMs, a bf16 matrix product's TFLOP/s,
and the device memory it could take in STEP_MIB cudaMallocs before the first one failed (up to N MiB); with S,
first `{"holding": true}`, then it computes for S seconds checking every result (a pod holding its replica while
the plugin or the MPS control daemon restarts).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.sharing import KEEP_ENV

STEP_MIB = 512


def run_client(cap_mib: int, hold_s: float) -> None:
    """Report SMs, TFLOP/s and the memory it could take (up to `cap_mib`); with `hold_s`, first compute for that
    long and check the result is still right."""
    import torch

    out: dict[str, Any] = {"sms": torch.cuda.get_device_properties(0).multi_processor_count}
    free, total = torch.cuda.mem_get_info()
    out |= {"free_mib": free // 2**20, "total_mib": total // 2**20}
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    if hold_s:
        print(json.dumps({"holding": True}), flush=True)
        ref = (a @ b).float().sum().item()
        end, iters, wrong = time.monotonic() + hold_s, 0, 0
        while time.monotonic() < end:
            wrong += int((a @ b).float().sum().item() != ref)
            iters += 1
        out |= {"hold_iters": iters, "hold_wrong": wrong}
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(20):
        a @ b
    t1.record()
    torch.cuda.synchronize()
    out["tflops"] = round(20 * 2 * 8192**3 / (t0.elapsed_time(t1) / 1e3) / 1e12, 1)
    del a, b
    torch.cuda.empty_cache()
    blocks, error = [], None
    while len(blocks) * STEP_MIB < cap_mib:
        try:
            blocks.append(torch.empty(STEP_MIB * 2**20, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError as e:
            error = str(e).splitlines()[0][:200]
            break
    out |= {"took_mib": len(blocks) * STEP_MIB, "failed": error is not None, "error": error}
    print(json.dumps(out), flush=True)


def client_env(envs: dict[str, str]) -> dict[str, str]:
    """The replica's env over a few of ours (paths, the GPU machine's NCCL settings), nothing else inherited: the
    client must see exactly the MPS settings its case names."""
    return {k: os.environ[k] for k in KEEP_ENV if k in os.environ} | envs | {"PYTHONUNBUFFERED": "1"}


def start_client(envs: dict[str, str], cap_mib: int, hold_s: float = 0.0) -> subprocess.Popen[str]:
    """The client in its own process with `envs` (its stdout a pipe: `client_result` reads it)."""
    return subprocess.Popen([sys.executable, "-m", "bench.mps_client", "--cap-mib", str(cap_mib),
                             "--hold-s", str(hold_s)], env=client_env(envs), stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parents[1])


def client_result(proc: subprocess.Popen[str], timeout_s: float = 120.0) -> dict[str, Any]:
    """The client's last JSON line and its exit status (an empty report when it died before printing one)."""
    out, _ = proc.communicate(timeout=timeout_s)
    lines = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    return {**(lines[-1] if lines else {}), "rc": proc.returncode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cap-mib", type=int, default=0, help="take device memory up to this many MiB (0: none)")
    ap.add_argument("--hold-s", type=float, default=0.0, help="first compute for this long, checking every result")
    args = ap.parse_args()
    run_client(args.cap_mib, args.hold_s)


if __name__ == "__main__":
    main()
