"""NVLink vs PCIe on real GPUs: `python -m bench.nccl [--sizes 2,4,8] [--name h200x2]` on a machine with GPUs.

For each request size it takes the GPU subsets each policy picks (this allocator, lowest index first, a seeded
random pick: what the kubelet does without a preference), measures NCCL all-reduce bus bandwidth (torch.distributed,
one process per GPU) from 1 MiB to 1 GiB on each distinct subset twice, over NVLink (NCCL's default) and through the
host (NCCL_P2P_DISABLE=1), and prints the measured GB/s next to the model's estimate for that subset.

bus bandwidth = algorithm bandwidth x 2(n-1)/n, as nccl-tests reports it. NVLink multicast stays off
(NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1) in every process it starts.
Writes bench/results/nccl-<name>.md and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sim.ports import free_port

SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
MESSAGE_MIB = (1, 4, 16, 64, 256, 1024)
ROOT = Path(__file__).resolve().parents[1]



def _worker(rank: int, world: int, port: int, sizes_mib: list[int], iters: int, out: str,
            device: int | None = None) -> None:
    """One rank's sweep. `device` is the CUDA index when it is not the rank: 0 in a process that sees only its own
    GPU, as a pod does (bench.train runs the "N pods" case through here)."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank if device is None else device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = []
    for mib in sizes_mib:
        n = mib * 1024 * 1024 // 4
        x = torch.ones(n, dtype=torch.float32, device="cuda")
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        elapsed = (time.perf_counter() - start) / iters
        # correctness: all ranks hold ones, so after k all-reduces every element is world^k
        x.fill_(1.0)
        dist.all_reduce(x)
        ok = bool(torch.all(x == world).item())
        algbw = mib * 1024 * 1024 / elapsed / 1e9
        results.append({"mib": mib, "seconds": elapsed, "algbw": algbw,
                        "busbw": algbw * 2 * (world - 1) / world, "correct": ok})
        del x
    dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(results))


def run_subset(gpus: list[int], host_path: bool, sizes_mib: list[int], iters: int) -> list[dict]:
    """One torch.multiprocessing run on exactly `gpus`, in a fresh process so NCCL reads its environment anew."""
    # PCI bus order makes CUDA's device numbers those of NVML (and so of the topology); CUDA's default is not.
    env = dict(os.environ, **SAFE_ENV, CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=",".join(map(str, gpus)))
    if host_path:
        env["NCCL_P2P_DISABLE"] = "1"
    else:
        env.pop("NCCL_P2P_DISABLE", None)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, "-m", "bench.nccl", "_worker", "--world", str(len(gpus)), "--port", str(free_port()),
           "--mib", ",".join(map(str, sizes_mib)), "--iters", str(iters), "--out", out]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"NCCL run on GPUs {gpus} failed:\n{proc.stderr[-3000:]}")
    return json.loads(Path(out).read_text())


def choose_subsets(topo, sizes: list[int], seed: int) -> list[tuple[int, str, list[int]]]:
    from gputopo.core import best_subset

    rng = random.Random(seed)
    picks = []
    for size in sizes:
        if size > topo.size:
            continue
        everyone = list(range(topo.size))
        ours = list(best_subset(topo, everyone, size).gpus)
        candidates = [("this allocator", ours), ("lowest index", everyone[:size]),
                      ("random (kubelet)", sorted(rng.sample(everyone, size)))]
        seen: dict[tuple[int, ...], list[str]] = {}
        for name, gpus in candidates:
            seen.setdefault(tuple(gpus), []).append(name)
        picks += [(size, " = ".join(names), list(gpus)) for gpus, names in seen.items()]
    return picks


def load_topology(path: str | None):
    if path:
        from gputopo.discovery.loader import load_topology_file

        return load_topology_file(path)
    from gputopo.discovery.nvml import discover
    from gputopo.discovery.nvml_backend import LiveNvmlBackend

    backend = LiveNvmlBackend()
    backend.init()
    try:
        return discover(backend)
    finally:
        backend.shutdown()


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for row in rows:
        label = f"{row['size']} GPUs {row['gpus']} ({row['policy']}) {'host' if row['host'] else 'NVLink'}"
        ax.plot([r["mib"] for r in row["results"]], [r["busbw"] for r in row["results"]],
                marker="o", linestyle="--" if row["host"] else "-", label=label)
        if not row["host"]:
            ax.axhline(row["estimate"], color=ax.lines[-1].get_color(), linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (MiB)")
    ax.set_ylabel("all-reduce bus bandwidth (GB/s)")
    ax.set_title(title + "\n(dotted: the model's estimate for the NVLink subset)")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,4,8", help="request sizes (those above the GPU count are skipped)")
    parser.add_argument("--name", default=None, help="results name, e.g. h200x2 (default: derived from the machine)")
    parser.add_argument("--topology", default=None, help="topology file instead of live NVML")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--machine", default="", help="machine description for the report")
    parser.add_argument("--render", default=None, help="re-render the report from a saved results JSON, no GPUs")
    args = parser.parse_args()
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        rows = saved["rows"] if isinstance(saved, dict) else saved
        render(rows, args.name or Path(args.render).stem.removeprefix("nccl-"),
               args.machine or saved.get("machine", "") if isinstance(saved, dict) else args.machine,
               args.sizes, args.iters)
        return
    for k, v in SAFE_ENV.items():
        os.environ[k] = v
    topo = load_topology(args.topology)
    sizes = [int(s) for s in args.sizes.split(",")]
    name = args.name or f"{(topo.gpus[0].model or 'gpu').split()[-1].lower()}x{topo.size}"
    from gputopo.core import allreduce_gbps

    rows = []
    for size, policy, gpus in choose_subsets(topo, sizes, args.seed):
        for host in (False, True):
            results = run_subset(gpus, host, list(MESSAGE_MIB), args.iters)
            rows.append({"size": size, "policy": policy, "gpus": gpus, "host": host, "results": results,
                         "estimate": allreduce_gbps(topo, gpus)})
            last = results[-1]
            print(f"{size} GPUs {gpus} {policy:<40} {'host  ' if host else 'NVLink'} "
                  f"1 GiB busbw {last['busbw']:7.1f} GB/s  model {allreduce_gbps(topo, gpus):7.1f} GB/s  "
                  f"correct {all(r['correct'] for r in results)}", flush=True)
    render(rows, name, args.machine or f"{topo.size}x {topo.gpus[0].model}, fabric {topo.fabric}", args.sizes,
           args.iters)


def render(rows: list[dict], name: str, machine: str, sizes: str, iters: int) -> None:
    """Markdown, JSON and PNG under bench/results/ (also re-rendered from a saved JSON with --render)."""
    results_dir = ROOT / "bench" / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    header = "| size | GPUs | picked by | path | " + " | ".join(f"{m} MiB" for m in MESSAGE_MIB) + " | model estimate |"
    lines = [header, "|" + "---|" * (5 + len(MESSAGE_MIB))]
    for row in rows:
        cells = " | ".join(f"{r['busbw']:.1f}" for r in row["results"])
        path = "host (NCCL_P2P_DISABLE=1)" if row["host"] else "NVLink (default)"
        # The model scores the subset by its best path; the forced host path has no estimate of its own.
        estimate = "-" if row["host"] else f"{row['estimate']:.1f}"
        lines.append(f"| {row['size']} | {row['gpus']} | {row['policy']} | {path} | {cells} | {estimate} |")
    md = (f"# NCCL all-reduce bus bandwidth (GB/s) on {machine}\n\n"
          f"`python -m bench.nccl --sizes {sizes} --name {name}` with "
          + " ".join(f"{k}={v}" for k, v in SAFE_ENV.items())
          + f"; {iters} timed iterations after 5 warm-ups per size; every result checked for the right sum "
          + f"({'all correct' if all(r['correct'] for row in rows for r in row['results']) else 'SOME WRONG'}).\n\n"
          + "\n".join(lines) + f"\n\n![nccl](nccl-{name}.png)\n")
    (results_dir / f"nccl-{name}.md").write_text(md)
    (results_dir / f"nccl-{name}.json").write_text(json.dumps({"machine": machine, "sizes": sizes, "iters": iters,
                                                                "rows": rows}, indent=1))
    plot(rows, results_dir / f"nccl-{name}.png", f"NCCL all-reduce on {machine}")
    print(md)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        p = argparse.ArgumentParser()
        p.add_argument("_worker")
        p.add_argument("--world", type=int)
        p.add_argument("--port", type=int)
        p.add_argument("--mib")
        p.add_argument("--iters", type=int)
        p.add_argument("--out")
        a = p.parse_args()
        import torch.multiprocessing as mp

        mp.spawn(_worker, args=(a.world, a.port, [int(x) for x in a.mib.split(",")], a.iters, a.out),
                 nprocs=a.world, join=True)
    else:
        main()
