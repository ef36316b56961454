"""Data-parallel training throughput, NVLink vs host path vs pods: `python -m bench.train [--sizes 2,4,8]` on GPUs.

The NCCL bench (bench/nccl.py) measures all-reduce bandwidth; what a placement costs a user is training throughput.
This runs torch DistributedDataParallel over NCCL on synthetic data (nothing is downloaded) for two models: ResNet-50
from torchvision, built without pretrained weights, on ImageNet-shaped images (compute-heavy, 102 MB of gradients a
step: communication mostly hides behind the backward pass), and a stack of transformer blocks on random tokens
(about 1 B parameters, 3.8 GB of gradients a step: communication matters). Per model and request size N:

  baseline  1 GPU, no DDP: the reference for scaling efficiency = items/s at N / (N x baseline items/s)
  nvlink    N GPUs on the subset this project's allocator picks, one process per GPU, all N visible to each
            (one pod of N GPUs): NCCL's default path, NVLink where there is one
  host      the same N GPUs with NCCL_P2P_DISABLE=1: through host memory, what a PCIe-only placement gets
  pods      N processes, each with CUDA_VISIBLE_DEVICES set to its own GPU only, as N pods of one GPU see them
  pods-net  as pods, and each process with its own NCCL_HOSTID: NCCL then takes the ranks for separate hosts, as it
            does for pods with their own hostnames and /dev/shm (no hostNetwork/hostIPC), and uses its network
            transport (sockets over loopback here, NCCL_SOCKET_IFNAME=lo)

For every N configuration it also measures the NCCL all-reduce bus bandwidth of that configuration with
bench/nccl.py's worker (1 MiB to 1 GiB, same columns as the NCCL bench), and notes the transport NCCL reports
(NCCL_DEBUG=INFO "via P2P/...", "via SHM/...", "via NET/..."), so the "N pods" figure sits next to the others.

Each measurement: warm-up iterations, then timed iterations (wall clock over the window, after a synchronise and a
barrier; per-step CUDA events for the median and p90). Checked: every loss finite; after the timed window the
DDP-averaged gradients are compared across ranks (all equal) and against the mean of the ranks' own gradients
(computed under no_sync), with per-rank data seeded apart so that agreement is not trivial; parameters equal across
ranks. The model's estimate beside each measurement: step time = 1-GPU step time + gradient bytes x 2(N-1)/N over
the estimated bus bandwidth (no overlap), or the larger of the two (full overlap); the bandwidth is the core's
all-reduce estimate for the subset (nvlink) or its host-path figure (host, pods, pods-net: DESIGN.md's model of pods
on one node). Sizes above the machine's GPU count are skipped and listed; `--sizes 1` runs every configuration at
world size 1 to exercise the whole path on one GPU. NVLink multicast stays off in every process (bench.nccl.SAFE_ENV).
Writes bench/results/train-<name>.md, .json, .png and train-<name>-nccl.png (re-render with --render JSON).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.common import RESULTS, ROOT, markdown_table
from bench.nccl import MESSAGE_MIB, SAFE_ENV, load_topology
from bench.nccl import _worker as allreduce_worker
from bench.nccl import plot as plot_allreduce
from sim.ports import free_port

if TYPE_CHECKING:
    from gputopo.core import Topology

MODELS = ("resnet50", "transformer")
# Gradients are compared as per-parameter sums relative to the sum of magnitudes. Ranks must agree to rounding;
# the DDP average and the mean of the ranks' own gradients come from two backward passes, whose kernels need not
# be deterministic (the transformer's attention backward differed by 2e-4 to 3e-4 between two passes on one H200),
# so that comparison gets more room. A real fault (a bucket not reduced, a sum not divided) is of order 1.
RANK_TOLERANCE = 1e-6
MEAN_TOLERANCE = 1e-2
# Variables a configuration sets; cleared first so that nothing from the caller's environment leaks into another.
_CONFIG_VARS = ("NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_HOSTID", "NCCL_SOCKET_IFNAME", "CUDA_VISIBLE_DEVICES")
# NCCL's channel lines: "Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read", "... [send] via NET/Socket/0"; older
# releases print "Channel 00 : 0[1b000] -> 1[1c000] via P2P/IPC".
_CHANNEL = re.compile(r"Channel \d+(?:/\d+)? : \S+ -> \S+(?: \[\w+\])? via (\S+)")


@dataclass(frozen=True)
class Config:
    """One way of running N data-parallel ranks on the same N GPUs."""

    key: str
    label: str
    pods: bool = False  # each process sees only its own GPU
    own_host_id: bool = False  # each process gets its own NCCL_HOSTID
    env: Mapping[str, str] = field(default_factory=dict)
    estimate: str = "host"  # which of the model's figures applies: "nvlink" (the subset's) or "host"


CONFIGS: tuple[Config, ...] = (
    Config("nvlink", "one pod of N GPUs (allocator's subset)", estimate="nvlink"),
    Config("host", "same GPUs, NCCL_P2P_DISABLE=1 (host path)", env={"NCCL_P2P_DISABLE": "1"}),
    Config("pods", "N pods (CUDA_VISIBLE_DEVICES = own GPU)", pods=True),
    Config("pods-net", "N pods, own NCCL_HOSTID each (separate hosts to NCCL)", pods=True, own_host_id=True,
           env={"NCCL_SOCKET_IFNAME": "lo"}),
)
BASELINE = Config("baseline", "1 GPU, no DDP (baseline)", estimate="none")
CONFIG_BY_KEY = {c.key: c for c in (*CONFIGS, BASELINE)}


# ----------------------------------------------------------------------------------------------- pure helpers


def rank_env(base: Mapping[str, str], config: Config, gpus: Sequence[int], rank: int) -> dict[str, str]:
    """The environment of one rank's process: multicast off, PCI bus order (CUDA's numbers = NVML's = the
    topology's), NCCL's transport log on, and only what this configuration sets."""
    env = {k: v for k, v in base.items() if k not in _CONFIG_VARS}
    env.update(SAFE_ENV, CUDA_DEVICE_ORDER="PCI_BUS_ID", NCCL_DEBUG="INFO", PYTHONUNBUFFERED="1")
    env.update(config.env)
    env["CUDA_VISIBLE_DEVICES"] = str(gpus[rank]) if config.pods else ",".join(map(str, gpus))
    if config.own_host_id:
        env["NCCL_HOSTID"] = f"bench-train-pod-{rank}"
    return env


def rank_device(config: Config, rank: int) -> int:
    """CUDA device index of a rank inside its process: a pod sees one GPU, numbered 0."""
    return 0 if config.pods else rank


def parse_transports(log: str) -> list[str]:
    """Distinct transports NCCL reported for its channels (P2P/CUMEM/read, SHM/direct/direct, NET/Socket/0...)."""
    return sorted({m.group(1) for m in _CHANNEL.finditer(log)})


def plan_sizes(requested: Sequence[int], gpu_count: int) -> tuple[list[int], list[str]]:
    """Sizes this machine can run, and a line for each it cannot (kept in the report, never silently dropped)."""
    run, skipped = [], []
    for n in requested:
        if n < 1:
            raise ValueError(f"request size must be at least 1, got {n}")
        if n > gpu_count:
            skipped.append(f"N={n}: this machine has {gpu_count} GPU{'s' if gpu_count != 1 else ''}")
        elif n not in run:
            run.append(n)
    return run, skipped


def host_path_gbps(topo: Topology, gpus: Sequence[int]) -> float:
    """The model's all-reduce estimate for `gpus` when NCCL goes through host memory (P2P off, or pods on one node).

    Every pair then moves data over the PCIe path to the host, so a pair's figure is the core's PCIe estimate for it;
    where NVLink hides the pair's PCIe class, the x16 figure of the node's PCIe generation (the ~24 GB/s that
    bandwidth.py compares with the 25.8 GB/s measured through host memory on 2x H200). Best ring's bottleneck, as
    for allreduce_gbps; 0.0 for one GPU.
    """
    from gputopo.core import bandwidth
    from gputopo.core.scoring import ring_bottleneck_mbps

    x16_mbps = round(bandwidth.PCIE_X16_GBPS[topo.pcie_generation] * 1000)
    n = topo.size
    matrix = [
        [
            0 if i == j else x16_mbps if topo.link(i, j).kind.is_nvlink else topo.bandwidth_mbps[i][j]
            for j in range(n)
        ]
        for i in range(n)
    ]
    return ring_bottleneck_mbps(matrix, list(gpus)) / 1000.0


def estimate_busbw(topo: Topology, config: Config, gpus: Sequence[int]) -> float:
    from gputopo.core import allreduce_gbps

    if len(gpus) < 2:
        return 0.0
    return allreduce_gbps(topo, gpus) if config.estimate == "nvlink" else host_path_gbps(topo, gpus)


def throughput_estimate(baseline_per_s: float, items_per_gpu_step: float, n: int, grad_bytes: int,
                        busbw_gbps: float) -> tuple[float, float]:
    """(no overlap, full overlap) items/s of n data-parallel GPUs, from the measured 1-GPU rate.

    One step computes for items_per_gpu_step / baseline_per_s on every GPU and all-reduces grad_bytes, which takes
    grad_bytes x 2(n-1)/n / bus bandwidth (bus bandwidth as nccl-tests defines it). DDP overlaps the all-reduce
    with the backward pass, so the truth lies between the sum of the two and the larger of them.
    """
    if baseline_per_s <= 0:
        return math.nan, math.nan
    compute_s = items_per_gpu_step / baseline_per_s
    if n <= 1:
        return baseline_per_s, baseline_per_s
    if busbw_gbps <= 0:
        return 0.0, 0.0
    comm_s = grad_bytes * 2 * (n - 1) / n / (busbw_gbps * 1e9)
    return n * items_per_gpu_step / (compute_s + comm_s), n * items_per_gpu_step / max(compute_s, comm_s)


def check_text(result: Mapping[str, Any]) -> str:
    """One cell saying whether the run's results hold up."""
    if not result["loss_finite"]:
        return "FAILED: non-finite loss"
    if result.get("grad_rank_diff") is None:
        return "loss finite"
    ok = (result["grad_rank_diff"] <= RANK_TOLERANCE and result["param_rank_diff"] <= RANK_TOLERANCE
          and result["grad_mean_err"] <= MEAN_TOLERANCE)
    return (f"{'ok' if ok else 'FAILED'}: loss finite, grads across ranks {result['grad_rank_diff']:.0e}, "
            f"vs mean of own {result['grad_mean_err']:.0e}, params {result['param_rank_diff']:.0e}")


def run_ok(result: Mapping[str, Any]) -> bool:
    return not check_text(result).startswith("FAILED")


def _fmt(x: float, digits: int = 0) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:,.{digits}f}"


def model_rows(data: Mapping[str, Any], model: str) -> list[list[str]]:
    """The table rows of one model: measurement, scaling efficiency and the model's estimate side by side."""
    runs = [r for r in data["runs"] if r["model"] == model]
    base = next((r for r in runs if r["config"] == "baseline"), None)
    base_rate = base["result"]["items_per_s"] if base else math.nan
    rows = []
    for r in runs:
        res, n = r["result"], r["size"]
        rate = res["items_per_s"]
        eff = rate / (n * base_rate) if base else math.nan
        if r["config"] == "baseline":
            est_cell, est_eff, busbw = "-", "-", "-"
        else:
            lo, hi = throughput_estimate(base_rate, res["items_per_gpu_step"], n, res["grad_bytes"],
                                         r["estimate_busbw_gbps"])
            est_cell = f"{_fmt(lo)} .. {_fmt(hi)}"
            est_eff = f"{lo / (n * base_rate):.3f} .. {hi / (n * base_rate):.3f}" if base else "-"
            busbw = f"{r['estimate_busbw_gbps']:.1f}" if n > 1 else "-"
        label = CONFIG_BY_KEY[r["config"]].label
        if n == 1 and r["config"] != "baseline":
            label += " [world size 1: path exercised, no traffic]"
        rows.append([str(n), label, str(r["gpus"]), ", ".join(r["transports"]) or "-", _fmt(rate),
                     f"{eff:.3f}" if not math.isnan(eff) else "-", est_cell, est_eff, busbw,
                     f"{res['step_ms_median']:.1f} / {res['step_ms_p90']:.1f}", check_text(res)])
    return rows


def render_markdown(data: Mapping[str, Any], name: str) -> str:
    """The report: one table per model, the all-reduce table, and what was skipped."""
    a = data["args"]
    lines = [
        f"# Data-parallel training throughput on {data['machine']}",
        "",
        f"`{data['command']}` with " + " ".join(f"{k}={v}" for k, v in SAFE_ENV.items())
        + f"; torch {data['torch']}, NCCL {data['nccl']}. {a['warmup']} warm-up and {a['iters']} timed iterations "
        "per configuration, synthetic data generated on the GPU (no input pipeline), bf16 autocast, SGD with momentum, "
        "fp32 gradients all-reduced by DistributedDataParallel (25 MB buckets). Scaling efficiency = items/s at N / "
        "(N x baseline items/s). Model estimate: 1-GPU step time plus gradient bytes x 2(N-1)/N over the estimated "
        "bus bandwidth (no overlap) .. the larger of the two (full overlap); bus bandwidth from the core: the "
        "subset's all-reduce estimate for the NVLink pod, its host-path figure for the others.",
        "",
    ]
    for model in data["models"]:
        info = data["models"][model]
        lines += [f"## {model}: {info['unit']}/s ({info['describe']})", "",
                  markdown_table(["N", "configuration", "GPUs", "NCCL transport", f"{info['unit']}/s",
                                  "scaling efficiency", f"model estimate {info['unit']}/s", "estimated efficiency",
                                  "busbw estimate GB/s", "step ms median / p90", "checks"],
                                 model_rows(data, model)), ""]
    if data["allreduce"]:
        header = ["size", "GPUs", "configuration", "NCCL transport",
                  *(f"{m} MiB" for m in data["allreduce"][0]["mib"]), "model estimate", "correct"]
        rows = [[str(r["size"]), str(r["gpus"]), CONFIG_BY_KEY[r["config"]].label, ", ".join(r["transports"]) or "-",
                 *(f"{x['busbw']:.1f}" for x in r["results"]),
                 f"{r['estimate_busbw_gbps']:.1f}" if r["size"] > 1 else "-",
                 "yes" if all(x["correct"] for x in r["results"]) else "NO"] for r in data["allreduce"]]
        lines += ["## NCCL all-reduce bus bandwidth (GB/s) of each configuration", "",
                  f"bench/nccl.py's worker, {a['nccl_iters']} timed iterations after 5 warm-ups per size, in the same "
                  "processes layout as the training runs (N pods: one GPU visible per process).", "",
                  markdown_table(header, rows), ""]
    lines += ["## Not run", ""]
    lines += [f"- {s}" for s in data["skipped"]] or ["- nothing: every requested size ran"]
    lines += ["", f"![throughput](train-{name}.png)"]
    if any(r["size"] > 1 for r in data["allreduce"]):
        lines += ["", f"![all-reduce](train-{name}-nccl.png)"]
    return "\n".join(lines) + "\n"


def plot(data: Mapping[str, Any], path: Path) -> None:
    """One panel per model: measured items/s per configuration, the estimate's range as a bar, N x baseline dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(data["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 5.5), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        runs = [r for r in data["runs"] if r["model"] == model]
        base = next((r for r in runs if r["config"] == "baseline"), None)
        base_rate = base["result"]["items_per_s"] if base else math.nan
        for x, r in enumerate(runs):
            res, n = r["result"], r["size"]
            color = f"C{[c.key for c in (BASELINE, *CONFIGS)].index(r['config'])}"
            ax.bar(x, res["items_per_s"], color=color, alpha=0.85)
            if base and n > 1:
                eff = res["items_per_s"] / (n * base_rate)
                ax.text(x, res["items_per_s"], f"{eff:.2f}", ha="center", va="bottom", fontsize=8)
            if base and r is not base:
                lo, hi = throughput_estimate(base_rate, res["items_per_gpu_step"], n, res["grad_bytes"],
                                             r["estimate_busbw_gbps"])
                ax.vlines(x + 0.3, lo, hi, color="black", linewidth=3)
                ax.hlines(n * base_rate, x - 0.4, x + 0.4, color="grey", linestyle=":")
        ax.set_xticks(range(len(runs)), [f"{r['config']} N={r['size']}" for r in runs], fontsize=7, rotation=45,
                      ha="right")
        ax.set_ylabel(f"{data['models'][model]['unit']}/s")
        ax.set_title(f"{model}\n(black: model estimate, no overlap..full overlap; dotted: N x 1 GPU; "
                     "label: scaling efficiency)", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"Data-parallel training on {data['machine']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render(data: Mapping[str, Any], name: str, results_dir: Path) -> str:
    """Markdown, JSON and PNGs under results_dir (also re-rendered from a saved JSON with --render)."""
    results_dir.mkdir(parents=True, exist_ok=True)
    md = render_markdown(data, name)
    (results_dir / f"train-{name}.md").write_text(md)
    (results_dir / f"train-{name}.json").write_text(json.dumps(data, indent=1))
    try:
        plot(data, results_dir / f"train-{name}.png")
        multi = [r for r in data["allreduce"] if r["size"] > 1]
        if multi:
            rows = [{"size": r["size"], "gpus": r["gpus"], "policy": r["config"], "host": r["config"] != "nvlink",
                     "results": r["results"], "estimate": r["estimate_busbw_gbps"]} for r in multi]
            plot_allreduce(rows, results_dir / f"train-{name}-nccl.png", f"NCCL all-reduce on {data['machine']}")
    except ImportError as exc:  # the GPU machine's image may lack matplotlib: --render the JSON where it is
        print(f"no PNG ({exc}); re-render with: python -m bench.train --render train-{name}.json", file=sys.stderr)
    return md


# ------------------------------------------------------------------------------------------------- launching


class RunFailed(RuntimeError):
    pass


def launch(config: Config, gpus: Sequence[int], task: list[str], timeout_s: float) -> tuple[Any, list[str]]:
    """One process per rank (a fresh process, so NCCL reads this configuration's environment), each with its own
    environment; rank 0's JSON and the transports NCCL logged. A failed rank takes the others down with it."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        out = Path(tmp) / "result.json"
        procs, logs = [], []
        for rank in range(len(gpus)):
            log_path = Path(tmp) / f"rank{rank}.log"
            logs.append(log_path)
            cmd = [sys.executable, "-m", "bench.train", "_rank", "--rank", str(rank), "--world", str(len(gpus)),
                   "--device", str(rank_device(config, rank)), "--port", str(port), "--out", str(out), *task]
            with log_path.open("w") as log:
                procs.append(subprocess.Popen(cmd, env=rank_env(os.environ, config, gpus, rank), cwd=ROOT,
                                              stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + timeout_s
        failed = None
        while any(p.poll() is None for p in procs):
            failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
            if failed is not None or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if failed is None:
            failed = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        texts = [log.read_text(errors="replace") for log in logs]
        if failed is not None or not out.exists():
            who = f"rank {failed}" if failed is not None else "a rank (timed out or wrote nothing)"
            tail = texts[failed if failed is not None else 0][-4000:]
            raise RunFailed(f"{config.key} on GPUs {list(gpus)}: {who} failed:\n{tail}")
        return json.loads(out.read_text()), parse_transports("\n".join(texts))


def _model_args(args: argparse.Namespace, model: str) -> dict[str, Any]:
    if model == "resnet50":
        return {"batch": args.resnet_batch}
    return {"batch": args.tf_batch, "seq": args.tf_seq, "width": args.tf_width, "layers": args.tf_layers,
            "heads": args.tf_heads, "vocab": args.tf_vocab}


def _describe(model: str, margs: Mapping[str, Any], result: Mapping[str, Any]) -> str:
    params = f"{result['params'] / 1e6:,.1f} M parameters, {result['grad_bytes'] / 1e6:,.0f} MB of fp32 gradients"
    if model == "resnet50":
        return f"torchvision ResNet-50, no pretrained weights, 224x224, batch {margs['batch']} per GPU; {params}"
    return (f"{margs['layers']} pre-norm transformer blocks, width {margs['width']}, {margs['heads']} heads, "
            f"vocabulary {margs['vocab']}, {margs['batch']} x {margs['seq']} tokens per GPU; {params}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2,4,8", help="request sizes N (those above the GPU count are skipped; 1 "
                        "runs every configuration at world size 1)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--configs", default=",".join(c.key for c in CONFIGS))
    parser.add_argument("--name", default=None, help="results name, e.g. h200x2 (default: derived from the machine)")
    parser.add_argument("--topology", default=None, help="topology file instead of live NVML")
    parser.add_argument("--machine", default="", help="machine description for the report")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--nccl-iters", type=int, default=20)
    parser.add_argument("--resnet-batch", type=int, default=256)
    parser.add_argument("--tf-batch", type=int, default=8)
    parser.add_argument("--tf-seq", type=int, default=1024)
    parser.add_argument("--tf-width", type=int, default=2048)
    parser.add_argument("--tf-layers", type=int, default=16)
    parser.add_argument("--tf-heads", type=int, default=16)
    parser.add_argument("--tf-vocab", type=int, default=32000)
    parser.add_argument("--timeout", type=float, default=540.0, help="seconds one configuration may take")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--render", default=None, help="re-render the report from a saved results JSON, no GPUs")
    args = parser.parse_args()
    if args.render:
        data = json.loads(Path(args.render).read_text())
        print(render(data, args.name or Path(args.render).stem.removeprefix("train-"), args.results_dir))
        return
    models = [m for m in args.models.split(",") if m]
    configs = [CONFIG_BY_KEY[k] for k in args.configs.split(",") if k]
    unknown = set(models) - set(MODELS)
    if unknown:
        parser.error(f"unknown model(s) {sorted(unknown)}; choose from {MODELS}")
    os.environ.update(SAFE_ENV)
    topo = load_topology(args.topology)
    sizes, skipped = plan_sizes([int(s) for s in args.sizes.split(",")], topo.size)
    for line in skipped:
        print(f"skipped {line}", flush=True)
    name = args.name or f"{(topo.gpus[0].model or 'gpu').split()[-1].lower()}x{topo.size}"
    from gputopo.core import best_subset

    data: dict[str, Any] = {
        "machine": args.machine or f"{topo.size}x {topo.gpus[0].model}, fabric {topo.fabric}",
        "command": shlex.join(["python", "-m", "bench.train", *sys.argv[1:]]),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "models": {}, "runs": [], "allreduce": [], "skipped": list(skipped), "torch": "?", "nccl": "?",
    }
    failures = 0
    everyone = list(range(topo.size))
    picks = {n: list(best_subset(topo, everyone, n).gpus) for n in sizes}
    picks.setdefault(1, list(best_subset(topo, everyone, 1).gpus))

    def record(kind: str, row: dict[str, Any], config: Config, gpus: list[int], task: list[str]) -> bool:
        nonlocal failures
        try:
            result, transports = launch(config, gpus, task, args.timeout)
        except RunFailed as exc:
            failures += 1
            data["skipped"].append(f"{row.get('model', 'all-reduce')} {config.key} N={len(gpus)}: run failed "
                                   f"({str(exc).splitlines()[0]})")
            print(exc, file=sys.stderr, flush=True)
            return False
        row.update(config=config.key, size=len(gpus), gpus=gpus, transports=transports,
                   estimate_busbw_gbps=estimate_busbw(topo, config, gpus))
        row["results" if kind == "allreduce" else "result"] = result
        data[kind].append(row)
        return True

    for model in models:
        margs = _model_args(args, model)
        task = ["train", "--model", model, "--model-args", json.dumps(margs), "--warmup", str(args.warmup),
                "--iters", str(args.iters)]
        if record("runs", {"model": model}, BASELINE, picks[1], [*task, "--no-ddp"]):
            res = data["runs"][-1]["result"]
            data["torch"], data["nccl"] = res["torch"], res["nccl"]
            data["models"][model] = {"unit": res["unit"], "describe": _describe(model, margs, res)}
            print(f"{model:<12} baseline     GPU {picks[1]}  {res['items_per_s']:10,.0f} {res['unit']}/s  "
                  f"{check_text(res)}", flush=True)
        for n in sizes:
            for config in configs:
                if record("runs", {"model": model}, config, picks[n], task):
                    row = data["runs"][-1]
                    res = row["result"]
                    print(f"{model:<12} {config.key:<12} N={n} GPUs {picks[n]}  {res['items_per_s']:10,.0f} "
                          f"{res['unit']}/s  via {', '.join(row['transports']) or '-'}  {check_text(res)}", flush=True)
    for n in sizes:
        for config in configs:
            task = ["allreduce", "--mib", ",".join(map(str, MESSAGE_MIB)), "--iters", str(args.nccl_iters)]
            if record("allreduce", {"mib": list(MESSAGE_MIB)}, config, picks[n], task):
                row = data["allreduce"][-1]
                print(f"all-reduce   {config.key:<12} N={n} GPUs {picks[n]}  1 GiB busbw "
                      f"{row['results'][-1]['busbw']:7.1f} GB/s  model {row['estimate_busbw_gbps']:7.1f} GB/s  via "
                      f"{', '.join(row['transports']) or '-'}  correct {all(x['correct'] for x in row['results'])}",
                      flush=True)
    data["models"] = {m: data["models"][m] for m in models if m in data["models"]}
    print(render(data, name, args.results_dir))
    bad = [r for r in data["runs"] if not run_ok(r["result"])]
    bad += [r for r in data["allreduce"] if not all(x["correct"] for x in r["results"])]
    if failures or bad:
        print(f"{failures} configuration(s) failed to run, {len(bad)} gave wrong results", file=sys.stderr)
        sys.exit(1)


# ----------------------------------------------------------------------------------------- inside one rank


def _build(model: str, margs: Mapping[str, Any], rank: int):
    """The model, one synthetic batch for this rank (seeded apart per rank), the loss and items per sample."""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)  # same initial weights on every rank (DDP broadcasts rank 0's anyway)
    gen = torch.Generator(device="cuda").manual_seed(1 + rank)
    batch = margs["batch"]
    if model == "resnet50":
        import torchvision

        net = torchvision.models.resnet50(weights=None).cuda().to(memory_format=torch.channels_last)
        images = torch.randn(batch, 3, 224, 224, device="cuda", generator=gen).contiguous(
            memory_format=torch.channels_last)
        labels = torch.randint(0, 1000, (batch,), device="cuda", generator=gen)
        return net, (images,), labels, nn.CrossEntropyLoss(), 1, "images", 0.01

    class BlockStack(nn.Module):
        """Token embedding, pre-norm transformer blocks and an output projection: a language-model-shaped stack."""

        def __init__(self, vocab: int, seq: int, width: int, heads: int, layers: int) -> None:
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.pos = nn.Parameter(torch.zeros(seq, width))
            block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, activation="gelu",
                                               batch_first=True, norm_first=True)
            self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(width)
            self.head = nn.Linear(width, vocab, bias=False)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.norm(self.blocks(self.embed(tokens) + self.pos)))

    seq, vocab = margs["seq"], margs["vocab"]
    net = BlockStack(vocab, seq, margs["width"], margs["heads"], margs["layers"]).cuda()
    tokens = torch.randint(0, vocab, (batch, seq), device="cuda", generator=gen)
    targets = torch.randint(0, vocab, (batch, seq), device="cuda", generator=gen)
    ce = nn.CrossEntropyLoss()

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ce(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))

    return net, (tokens,), targets, loss_fn, seq, "tokens", 1e-3


def _train_rank(rank: int, world: int, device: int, port: int, model: str, margs: dict[str, Any], warmup: int,
                iters: int, ddp: bool, out: str) -> None:
    """Warm up, time `iters` steps, then check the results; rank 0 writes the JSON."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.cuda.set_device(device)
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if ddp:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", device))
    model_, inputs, targets, loss_fn, per_sample, unit, lr = _build(model, margs, rank)
    params = [p for p in model_.parameters() if p.requires_grad]
    net = (DistributedDataParallel(model_, device_ids=[device], gradient_as_bucket_view=True) if ddp else model_)
    opt = torch.optim.SGD(params, lr=lr, momentum=0.9)

    def forward_loss() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return loss_fn(net(*inputs), targets)

    def step() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = forward_loss()
        loss.backward()
        opt.step()
        return loss.detach()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    if ddp:
        dist.barrier()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    losses = []
    start = time.perf_counter()
    events[0].record()
    for i in range(iters):
        losses.append(step())
        events[i + 1].record()
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    step_ms = sorted(events[i].elapsed_time(events[i + 1]) for i in range(iters))
    loss_values = torch.stack(losses).float().cpu()
    result: dict[str, Any] = {
        "unit": unit, "items_per_gpu_step": margs["batch"] * per_sample, "iters": iters, "warmup": warmup,
        "params": sum(p.numel() for p in params), "grad_bytes": sum(p.numel() * p.element_size() for p in params),
        "loss_first": float(loss_values[0]), "loss_last": float(loss_values[-1]),
        "loss_finite": bool(torch.isfinite(loss_values).all()),
        "step_ms_median": statistics.median(step_ms), "step_ms_p90": step_ms[min(iters - 1, int(0.9 * iters))],
        "torch": torch.__version__, "nccl": _nccl_version(),
        "gpu": torch.cuda.get_device_name(device),
    }
    if ddp:
        result.update(_sync_checks(net, params, forward_loss, opt, world))
        times = [torch.zeros(1, dtype=torch.float64, device="cuda") for _ in range(world)]
        dist.all_gather(times, torch.tensor([elapsed], dtype=torch.float64, device="cuda"))
        elapsed = max(float(t) for t in times)  # the slowest rank sets the pace
    result["elapsed_s"] = elapsed
    result["items_per_s"] = world * result["items_per_gpu_step"] * iters / elapsed
    if ddp:
        dist.destroy_process_group()
    if rank == 0:
        Path(out).write_text(json.dumps(result))


def _nccl_version() -> str:
    import torch

    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _sync_checks(net, params, forward_loss, opt, world: int) -> dict[str, Any]:
    """Gradients in sync across ranks and equal to the mean of each rank's own gradients; parameters equal.

    Compared as per-parameter sums in float64 relative to the sum of magnitudes, so that a missed bucket, a wrong
    average or a rank that drifted shows up without moving whole gradients between GPUs.
    """
    import torch
    import torch.distributed as dist

    def sums(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.stack([t.detach().sum(dtype=torch.float64) for t in tensors]),
                torch.stack([t.detach().abs().sum(dtype=torch.float64) for t in tensors]))

    def gather(x: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        return parts

    opt.zero_grad(set_to_none=False)
    with net.no_sync():
        own_loss = forward_loss()
        own_loss.backward()
    own, own_abs = sums([p.grad for p in params])
    opt.zero_grad(set_to_none=False)
    forward_loss().backward()
    synced, _ = sums([p.grad for p in params])
    mean_own, scale = own.clone(), own_abs.clone()
    dist.all_reduce(mean_own)
    dist.all_reduce(scale)
    mean_own, scale = mean_own / world, scale / world + 1e-30
    grad_rank_diff = max(float(((g - synced).abs() / scale).max()) for g in gather(synced))
    grad_mean_err = float(((synced - mean_own).abs() / scale).max())
    psum, pabs = sums(params)
    param_rank_diff = max(float(((g - psum).abs() / (pabs + 1e-30)).max()) for g in gather(psum))
    rank_losses = [float(x) for x in gather(own_loss.detach().double().reshape(1))]
    return {"grad_rank_diff": grad_rank_diff, "grad_mean_err": grad_mean_err, "param_rank_diff": param_rank_diff,
            "rank_losses": rank_losses, "ranks_saw_different_data": len(set(rank_losses)) == world}


def _rank_main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="bench.train _rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--device", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True)
    sub = p.add_subparsers(dest="task", required=True)
    t = sub.add_parser("train")
    t.add_argument("--model", choices=MODELS, required=True)
    t.add_argument("--model-args", required=True)
    t.add_argument("--warmup", type=int, required=True)
    t.add_argument("--iters", type=int, required=True)
    t.add_argument("--no-ddp", action="store_true")
    r = sub.add_parser("allreduce")
    r.add_argument("--mib", required=True)
    r.add_argument("--iters", type=int, required=True)
    a = p.parse_args(argv)
    if a.task == "train":
        _train_rank(a.rank, a.world, a.device, a.port, a.model, json.loads(a.model_args), a.warmup, a.iters,
                    not a.no_ddp, a.out)
    else:
        allreduce_worker(a.rank, a.world, a.port, [int(x) for x in a.mib.split(",")], a.iters, a.out, a.device)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_rank":
        _rank_main(sys.argv[2:])
    else:
        main()
