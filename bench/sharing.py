"""Sharing one real GPU: `python -m bench.sharing` on a GPU machine (the lent H200), then
`python -m bench.sharing --report FILE.json` anywhere, which writes bench/results/sharing.md and sharing.png.

For N = 1, 2, 4, 7 ResNet-50 inference processes (bf16, synthetic input, batch 1 and 16) on GPU 0, time-sliced
and MPS: the plugin's own path decides what each process gets. NVML discovery of the real GPU, a
SharedResourceManager over it (replicas = max(N, 2)), GetPreferredAllocation for one replica at a time, Allocate,
and under MPS the plugin's MpsDaemon running the real `nvidia-cuda-mps-control -d` with its pipe and log
directories under a fresh root in /tmp (stopped with `quit` after each group, and waited for). Every worker is
started with the environment Allocate returned (on top of the process's own PATH and Python settings); the mounts
are the pipe directory at its own path (so nothing to bind) and <root>/shm for /dev/shm, which processes on one
host share anyway. NVIDIA_VISIBLE_DEVICES is for a container runtime and changes nothing for a host process; the
daemon is given the GPU by CUDA_VISIBLE_DEVICES. Compute mode and MIG are left as they are.

Per process: images/s over a common window after warm-up, p50/p99 latency of one batch (synchronised), peak
memory reserved against CUDA_MPS_PINNED_DEVICE_MEM_LIMIT, the multiprocessors CUDA shows it (the thread percentage
applied). `--harness` picks how the model runs (HARNESS_NOTE); the default, channels_last, is the layout cuDNN's
bf16 convolutions run natively: NCHW (last session's harness) spent GPU time on layout transposes and capped MPS
at ~8,000 img/s however many processes shared the GPU. The anchor is the issue's table (issue 22), measured with
hand-started processes: MPS through the plugin's environment should reach >= 0.95 of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS, markdown_table, percentile

COUNTS = (1, 2, 4, 7)
BATCHES = (1, 16)
# issue 22's anchor table (total images/s; 1 process is time-sliced in the anchor)
ANCHOR = {("time-slicing", 1, 1): 157, ("time-slicing", 4, 1): 647, ("mps", 4, 1): 551, ("time-slicing", 7, 1): 714,
          ("mps", 7, 1): 1076, ("time-slicing", 1, 16): 2318, ("time-slicing", 4, 16): 6865, ("mps", 4, 16): 11374,
          ("time-slicing", 7, 16): 7820, ("mps", 7, 16): 11850}
RESOURCE = "nvidia.com/gpu"
KEEP_ENV = ("PATH", "HOME", "PYTHONPATH", "LD_LIBRARY_PATH", "NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
            "NVSHMEM_DISABLE_NVLS", "PYTHONUNBUFFERED", "TMPDIR")


# -- the worker: one inference process ---------------------------------------------------------------------------


HARNESSES = ("nchw", "cl", "cl-graph")
HARNESS_NOTE = {"nchw": "eager, NCHW (last session's harness)", "cl": "eager, channels_last",
                "cl-graph": "channels_last, one CUDA graph per batch replayed"}


def worker(batches: list[int], harnesses: list[str], seconds: float, warmup: int) -> None:
    """Load ResNet-50, then for each batch size and harness: say ready, wait for 'go', measure, print a JSON line.

    Harnesses: `nchw` is eager PyTorch on the default NCHW layout; `cl` the same in channels_last, the layout
    cuDNN's bf16 tensor-core convolutions run natively (NCHW adds layout transposes around every convolution,
    which under MPS cost all processes GPU time); `cl-graph` replays one CUDA graph per batch (no Python launch
    cost per kernel). Every harness synchronises after each batch, so latency is one batch's."""
    import torch
    import torchvision

    torch.backends.cudnn.benchmark = True
    torch.set_num_threads(1)  # nothing runs on the CPU but launches; N processes x all cores only contend
    model = torchvision.models.resnet50(weights=None).to("cuda", dtype=torch.bfloat16).eval()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for bs in batches:
        for harness in harnesses:
            fmt = torch.channels_last if harness.startswith("cl") else torch.contiguous_format
            model = model.to(memory_format=fmt)
            x = torch.randn(bs, 3, 224, 224, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=fmt)
            with torch.inference_mode():
                for _ in range(warmup):
                    model(x)
                torch.cuda.synchronize()
                if harness.endswith("graph"):
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        model(x)
                    step = graph.replay
                else:
                    def step(model: torch.nn.Module = model, x: torch.Tensor = x) -> None:
                        model(x)
                step()
                torch.cuda.synchronize()
                print(json.dumps({"ready": [bs, harness]}), flush=True)
                sys.stdin.readline()  # go
                lat: list[float] = []
                start = time.perf_counter()
                end = start + seconds
                while True:
                    t = time.perf_counter()
                    if t >= end:
                        break
                    step()
                    torch.cuda.synchronize()
                    lat.append(time.perf_counter() - t)
                wall = time.perf_counter() - start
            print(json.dumps({"bs": bs, "harness": harness, "ips": len(lat) * bs / wall,
                              "p50_ms": percentile(lat, 50) * 1e3, "p99_ms": percentile(lat, 99) * 1e3,
                              "iters": len(lat), "sms": sms,
                              "reserved_mib": torch.cuda.max_memory_reserved() / 2**20}), flush=True)


# -- the driver: the plugin's Allocate path, then the workers -----------------------------------------------------


def _discover() -> Any:
    from gputopo.discovery.nvml import discover_node
    from gputopo.discovery.nvml_backend import LiveNvmlBackend

    backend = LiveNvmlBackend()
    backend.init()
    node = discover_node(backend)
    return node, backend


def until_answering(daemon: Any, timeout_s: float = 30.0) -> None:
    """Step the plugin's daemon runner until its daemon answers (a daemon told to quit a moment ago may still be
    ending: the runner waits for it rather than start a second one)."""
    end = time.monotonic() + timeout_s
    while True:
        delay = daemon.step()
        if daemon.healthy:
            return
        if time.monotonic() > end:
            raise SystemExit(f"MPS daemon did not answer under {daemon.share.pipe_dir}: {daemon.state}")
        time.sleep(min(delay, 0.5))


def quit_and_wait(daemon: Any, timeout_s: float = 30.0) -> None:
    """`quit`, then wait until no control daemon is left on the pipe directory."""
    daemon.quit()
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        state = daemon.probe()
        if not state.answers and not state.alive:
            return
        time.sleep(0.1)
    raise SystemExit(f"MPS daemon under {daemon.share.pipe_dir} did not end: {daemon.state}")


def _allocations(mode: str, n: int, topo: Any, minors: dict[int, int], root: Path) -> tuple[list[Any], Any, Any]:
    """n Allocate answers of one replica each, through GetPreferredAllocation as the kubelet asks it."""
    from gpuplugin.sharing.layout import SharedSet
    from gpuplugin.sharing.manager import SharedResourceManager
    from gpuplugin.sharing.mps import MpsDaemon, MpsGpu, MpsShare

    replicas = max(n, 2)
    strategy = "time-slicing" if mode == "time-slicing" else "mps"
    shared = SharedSet(RESOURCE, strategy, True, True, ((0, replicas),))
    gpu = topo.gpus[0]
    share = MpsShare(RESOURCE, root, (MpsGpu(gpu.id, replicas, gpu.memory_mib),)) if strategy == "mps" else None
    manager = SharedResourceManager(topo, shared, mps=share, minors=minors)
    daemon = None
    if share is not None:
        daemon = MpsDaemon(share, manager.set_service_health, interval_s=1.0)
        until_answering(daemon)  # starts the real control daemon (or adopts one) and applies the defaults
        if mode == "mps-nolimit":  # a diagnosis, not the product: what the compute limit costs
            daemon.send("set_default_active_thread_percentage 100")
    free = [s.device.id for s in manager.snapshot() if s.healthy]
    if len(free) < replicas:
        raise SystemExit(f"{len(free)} healthy replicas, {replicas} expected")
    out = []
    for _ in range(n):
        pref = manager.preferred(free, [], 1)
        alloc = manager.allocate(list(pref.ids))
        if mode == "mps-nolimit":
            alloc = dataclasses.replace(alloc, envs={k: v for k, v in alloc.envs.items()
                                                     if k != "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"})
        free = [x for x in free if x not in pref.ids]
        out.append(alloc)
    return out, manager, daemon


def _run_group(mode: str, n: int, batches: list[int], harnesses: list[str], seconds: float, warmup: int,
               allocs: list[Any]) -> list[dict]:
    procs = []
    for alloc in allocs:
        env = {k: os.environ[k] for k in KEEP_ENV if k in os.environ} | dict(alloc.envs)
        env["PYTHONUNBUFFERED"] = "1"
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "bench.sharing", "--worker", "--batches", ",".join(map(str, batches)),
             "--harness", ",".join(harnesses), "--seconds", str(seconds), "--warmup", str(warmup)],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1]))
    rows: list[dict] = []
    try:
        for bs in batches:
            for harness in harnesses:
                for p in procs:
                    line = p.stdout.readline() if p.stdout else ""
                    if json.loads(line or "{}").get("ready") != [bs, harness]:
                        raise SystemExit(f"worker said {line!r} before batch {bs} {harness}")
                for p in procs:  # all together
                    assert p.stdin is not None
                    p.stdin.write("go\n")
                    p.stdin.flush()
                results = [json.loads(p.stdout.readline()) for p in procs if p.stdout]
                limit = allocs[0].envs.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
                rows.append({"mode": mode, "n": n, "bs": bs, "harness": harness,
                             "total_ips": round(sum(r["ips"] for r in results), 1),
                             "per_proc_ips": [round(r["ips"], 1) for r in results],
                             "p50_ms": [round(r["p50_ms"], 2) for r in results],
                             "p99_ms": [round(r["p99_ms"], 2) for r in results],
                             "reserved_mib": [round(r["reserved_mib"]) for r in results],
                             "sms": [r["sms"] for r in results],
                             "mem_limit": limit, "threads": allocs[0].envs.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
                             "env": dict(allocs[0].envs), "mounts": [(m.container_path, m.host_path)
                                                                     for m in allocs[0].mounts]})
                print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("env", "mounts")}), flush=True)
    finally:
        for p in procs:
            if p.stdin:
                p.stdin.close()
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    return rows


def measure(out: Path, counts: list[int], batches: list[int], modes: list[str], harnesses: list[str],
            seconds: float, warmup: int, root: Path) -> None:
    node, backend = _discover()
    topo = node.topology
    minors = {i: d.minor for i, d in enumerate(node.devices) if d.minor is not None}
    print(json.dumps({"gpus": [(g.id, g.model, g.memory_mib) for g in topo.gpus]}), flush=True)
    rows: list[dict] = []
    root.mkdir(parents=True, exist_ok=True)
    try:
        for mode in modes:
            for n in counts:
                allocs, manager, daemon = _allocations(mode, n, topo, minors, root)
                try:
                    rows += _run_group(mode, n, batches, harnesses, seconds, warmup, allocs)
                finally:
                    if daemon is not None:
                        quit_and_wait(daemon)
                    manager.close()
                out.write_text(json.dumps({"gpu": topo.gpus[0].model, "rows": rows}, indent=1))
    finally:
        backend.shutdown()


# -- the report ---------------------------------------------------------------------------------------------------


def _harness(row: dict) -> str:
    return row.get("harness", "nchw")  # runs before harnesses were named used NCHW


def report(path: Path) -> None:
    data = json.loads(path.read_text())
    rows = data["rows"]
    main = "cl" if any(_harness(r) == "cl" for r in rows) else _harness(rows[0])
    table = []
    for r in rows:
        anchor = ANCHOR.get((r["mode"], r["n"], r["bs"]))
        table.append([r["mode"], _harness(r), r["n"], r["bs"], r["total_ips"],
                      f"{min(r['per_proc_ips'])}-{max(r['per_proc_ips'])}", f"{max(r['p50_ms'])}",
                      f"{max(r['p99_ms'])}", f"{max(r['reserved_mib'])}", r["mem_limit"] or "-", r["threads"] or "-",
                      min(r["sms"]) if r.get("sms") else "-",
                      f"{anchor} ({r['total_ips'] / anchor:.2f})" if anchor else "-"])
    lines = []
    for h in dict.fromkeys(_harness(r) for r in rows):
        ratios = [f"N={r['n']} batch {r['bs']}: {r['total_ips'] / ANCHOR[('mps', r['n'], r['bs'])]:.2f}"
                  for r in rows if r["mode"] == "mps" and _harness(r) == h and ("mps", r["n"], r["bs"]) in ANCHOR]
        if ratios:
            lines.append(f"- harness {h} ({HARNESS_NOTE[h]}): " + "; ".join(ratios))
    free: dict[tuple, list[float]] = {}
    limited: dict[tuple, list[float]] = {}
    for r in rows:
        if r["mode"] in ("mps", "mps-nolimit"):
            into = free if r["mode"] == "mps-nolimit" else limited
            into.setdefault((r["n"], r["bs"], _harness(r)), []).append(r["total_ips"])
    # a run measures both modes of a case, so the k-th no-limit row pairs with the last k-th limited rows
    same = [f"N={n} batch {bs} {h}: " + ", ".join(f"{a / b:.2f}" for a, b in zip(
        limited[(n, bs, h)][-len(v):], v, strict=False)) for (n, bs, h), v in sorted(free.items())
        if (n, bs, h) in limited]
    env = next((r["env"] for r in rows if r["mode"] == "mps"), {})
    mounts = next((r["mounts"] for r in rows if r["mode"] == "mps"), [])
    text = "\n".join([
        "# Sharing one GPU: time-slicing and MPS through the plugin's Allocate",
        "",
        f"Measured with `python -m bench.sharing` on the lent {data['gpu']} (one GPU), report by "
        f"`python -m bench.sharing --report {path}`. ResNet-50 inference, bf16, synthetic input; every process "
        "started with the environment the plugin's Allocate returned for its replica (replicas = max(N, 2), "
        "failRequestsGreaterThanOne). Columns: total and per-process images/s, worst process's p50 / p99 latency of "
        "one batch, worst peak memory reserved by PyTorch vs the per-client pinned-memory limit, thread percentage, "
        "the multiprocessors CUDA showed each process (the thread percentage applied), and the issue's anchor "
        "(ratio). Harnesses: " + "; ".join(f"`{k}` {v}" for k, v in HARNESS_NOTE.items()) + ".",
        "",
        markdown_table(["mode", "harness", "N", "batch", "total img/s", "per process", "p50 ms", "p99 ms",
                        "reserved MiB", "mem limit", "threads %", "SMs", "anchor (ratio)"], table),
        "",
        "MPS via the plugin's environment vs the anchor's MPS figures (target >= 0.95):",
        *lines,
        "",
        ("Same machine, same harness, MPS with the plugin's limits vs MPS with no compute limit (mode mps-nolimit: "
         "the daemon default set to 100% and the client's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE dropped): "
         + "; ".join(same) + ".") if same else "",
        "",
        f"An MPS worker's environment (N={next((r['n'] for r in rows if r['mode'] == 'mps'), '-')}): "
        f"`{json.dumps(env)}`; mounts `{mounts}`.",
        "",
        f"Runs: {data['note']}" if data.get("note") else "",
        "",
        f"![images/s per N, harness {main}](sharing.png)",
        "",
    ])
    (RESULTS / "sharing.md").write_text(text)
    _plot([r for r in rows if _harness(r) == main], RESULTS / "sharing.png", main)
    print(text)


def _plot(rows: list[dict], png: Path, harness: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, bs in zip(axes, BATCHES, strict=True):
        for mode, style in (("time-slicing", "o-"), ("mps", "s-")):
            pts = sorted((r["n"], r["total_ips"]) for r in rows if r["mode"] == mode and r["bs"] == bs)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{mode} (plugin env)")
            anchor = sorted((n, v) for (m, n, b), v in ANCHOR.items() if m == mode and b == bs)
            if anchor:
                ax.plot([p[0] for p in anchor], [p[1] for p in anchor], style, alpha=0.3, label=f"{mode} anchor")
        ax.set_title(f"ResNet-50 bf16, batch {bs}, harness {harness}")
        ax.set_xlabel("processes on one GPU")
        ax.set_ylabel("total images/s")
        ax.set_xticks(COUNTS)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--report", type=Path, help="write bench/results/sharing.md and .png from this JSON")
    ap.add_argument("--out", type=Path, default=Path("sharing.json"), help="where the measured JSON goes")
    ap.add_argument("--counts", default=",".join(map(str, COUNTS)))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--modes", default="time-slicing,mps",
                    help="time-slicing, mps, mps-nolimit (MPS without the compute limit: what it costs)")
    ap.add_argument("--harness", default="cl", help="comma list of " + ", ".join(
        f"{k} ({v})" for k, v in HARNESS_NOTE.items()))
    ap.add_argument("--seconds", type=float, default=6.0, help="measured seconds per batch size")
    ap.add_argument("--warmup", type=int, default=30, help="warm-up batches per batch size")
    ap.add_argument("--mps-root", type=Path, default=Path("/tmp/mps-bench"),
                    help="MPS root: <root>/nvidia.com/gpu/{pipe,log} (stop with: echo quit | "
                         "CUDA_MPS_PIPE_DIRECTORY=<root>/nvidia.com/gpu/pipe nvidia-cuda-mps-control)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    harnesses = args.harness.split(",")
    if not set(harnesses) <= set(HARNESSES):
        ap.error(f"--harness: one of {', '.join(HARNESSES)}")
    if args.worker:
        worker(batches, harnesses, args.seconds, args.warmup)
    elif args.report:
        report(args.report)
    else:
        measure(args.out, [int(c) for c in args.counts.split(",")], batches, args.modes.split(","), harnesses,
                args.seconds, args.warmup, args.mps_root)


if __name__ == "__main__":
    main()
