"""The end-to-end demo: simulated GPU nodes, the real plugin and extender, a stream of pods, and the comparison.

For each pod: kube-scheduler's filter, prioritize and bind against the extender (real HTTP); then the kubelet's
admission on the chosen node (GetPreferredAllocation and Allocate against that node's real plugin process over its
unix socket). The table shows where each pod landed, its GPUs, their estimated all-reduce bandwidth, and what a
topology-blind placement would have given on the same node (the kubelet's random pick: the mean over every subset of
that node's free GPUs). A few pods finish midway, so later pods land on partly used nodes.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from gputopo.core import VS_EMPTY, allreduce_gbps, best_possible_gbps, efficiency_ratio
from gputopo.core.blind import blind_pick
from sim.cluster import RESOURCE, LocalCluster
from sim.scheduler import SchedulerDriver, gpu_pod

NODES = (
    ("dgx1-v100-a", "dgx1-v100-hybrid-cube-mesh.txt"),
    ("dgx1-v100-b", "dgx1-v100-hybrid-cube-mesh.txt"),
    ("a6000-bridges", "pcie-8x-rtxa6000-nvlink-bridge-pairs.txt"),
    ("p4d-a100-nvswitch", "aws-p4d-8x-a100-nvswitch.txt"),
    ("rtx5090-pcie", "pcie-8x-rtx5090-2socket.txt"),
)
SIZES = (1, 2, 4, 8)


@dataclass
class PodRow:
    name: str
    size: int
    node: str | None
    gpus: list[int]
    ids: list[str]
    gbps: float
    blind_gbps: float
    plan_honoured: bool
    note: str
    best_gbps: float = 0.0


def bundled(name: str) -> Path:
    return Path(str(resources.files("gputopo.data").joinpath(name)))


def stream(seed: int, count: int) -> list[tuple[str, int, int | None]]:
    """(pod name, GPUs, index of an earlier pod that finishes before this one arrives, or None)."""
    rng = random.Random(seed)
    out: list[tuple[str, int, int | None]] = []
    for k in range(count):
        size = rng.choices(SIZES, (3, 4, 3, 2))[0]
        finish = rng.randrange(k) if k > 6 and rng.random() < 0.2 else None
        out.append((f"train-{k:02d}-{size}gpu", size, finish))
    return out


def run(seed: int = 7, pods: int = 26, progress: Callable[[str], None] = print) -> tuple[list[PodRow], list[str]]:
    rows: list[PodRow] = []
    with LocalCluster([(name, bundled(f)) for name, f in NODES]) as cluster:
        progress(f"cluster up: {len(cluster.nodes)} nodes ({', '.join(cluster.nodes)}), plugins registered, "
                 f"extender at {cluster.extender_url}")
        driver = SchedulerDriver(cluster.extender_url, seed=seed)
        bound: dict[int, tuple[dict, str, list[str]]] = {}
        try:
            for k, (name, size, finish) in enumerate(stream(seed, pods)):
                if finish is not None and finish in bound:
                    pod, node_name, ids = bound.pop(finish)
                    driver.finish(pod)
                    cluster.nodes[node_name].allocated.difference_update(ids)
                    progress(f"  {pod['metadata']['name']} finished on {node_name}: GPUs freed")
                pod = gpu_pod(name, size)
                decision = driver.schedule(pod, list(cluster.nodes))
                if decision.node is None:
                    rows.append(PodRow(name, size, None, [], [], 0.0, 0.0, False, decision.reason))
                    progress(f"[{k + 1}/{pods}] {name}: {decision.reason}")
                    continue
                node = cluster.nodes[decision.node]
                plan = next(p["plan"] for p in driver.inventory()["pods"] if p["uid"] == pod["metadata"]["uid"])
                planned = [i for c in plan["containers"].values() for i in c]
                free = node.free_ids()
                # kubelet admission on that node: preference, then Allocate, over the plugin's unix socket
                chosen = node.kubelet.preferred(RESOURCE, free, [], size)
                node.kubelet.allocate(RESOURCE, chosen)
                node.allocated.update(chosen)
                bound[k] = (pod, node.name, chosen)
                topo = node.topology
                idx = topo.indices_of(chosen)
                blind = blind_pick(topo, topo.indices_of(free), size).random_mean_gbps
                best = best_possible_gbps(topo, size) if size > 1 else 0.0
                row = PodRow(name, size, node.name, sorted(idx), chosen, allreduce_gbps(topo, idx), blind,
                             sorted(planned) == sorted(chosen), "", best)
                rows.append(row)
                estimate = f"{row.gbps:.1f} GB/s (blind avg {blind:.1f})" if size > 1 else "(single GPU)"
                progress(f"[{k + 1}/{pods}] {name} -> {node.name} GPUs {','.join(map(str, row.gpus))} {estimate}")
        finally:
            driver.close()
        left = cluster.leftovers
    return rows, left()


def table(rows: list[PodRow]) -> str:
    head = f"{'pod':<18}{'GPUs':>5}  {'node':<19}{'chosen GPUs':<18}{'est. GB/s':>10}{'blind avg':>11}{'gain':>7}  plan"
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.node is None:
            lines.append(f"{r.name:<18}{r.size:>5}  {r.note}")
            continue
        gain = f"{r.gbps / r.blind_gbps:.2f}x" if r.size > 1 and r.blind_gbps else "-"
        gbps = f"{r.gbps:.1f}" if r.size > 1 else "-"
        blind = f"{r.blind_gbps:.1f}" if r.size > 1 else "-"
        lines.append(f"{r.name:<18}{r.size:>5}  {r.node:<19}{','.join(map(str, r.gpus)):<18}{gbps:>10}{blind:>11}"
                     f"{gain:>7}  {'honoured' if r.plan_honoured else 'DIFFERS'}")
    multi = [r for r in rows if r.node and r.size > 1]
    if multi:
        ours = sum(r.gbps for r in multi) / len(multi)
        blind = sum(r.blind_gbps for r in multi) / len(multi)
        eff = sum(efficiency_ratio(r.gbps, r.best_gbps, r.size) for r in multi) / len(multi)
        blind_eff = sum(efficiency_ratio(r.blind_gbps, r.best_gbps, r.size) for r in multi) / len(multi)
        lines += ["", f"multi-GPU pods placed: {len(multi)}; mean estimated all-reduce {ours:.1f} GB/s here vs "
                      f"{blind:.1f} GB/s for a topology-blind pick on the same nodes ({ours / blind:.2f}x); "
                      f"mean {VS_EMPTY} {eff:.3f} vs {blind_eff:.3f}; "
                      f"plans honoured by the plugin: {sum(r.plan_honoured for r in rows if r.node)}/"
                      f"{sum(1 for r in rows if r.node)}"]
    return "\n".join(lines)


def chart(rows: list[PodRow], path: Path) -> bool:
    """Writes the bar chart; False when matplotlib (the `plot` extra) is not installed, which only skips the PNG."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    multi = [r for r in rows if r.node and r.size > 1]
    fig, ax = plt.subplots(figsize=(12, 5))
    xs = range(len(multi))
    ax.bar([x - 0.2 for x in xs], [r.gbps for r in multi], width=0.4, label="topology-aware (this project)")
    ax.bar([x + 0.2 for x in xs], [r.blind_gbps for r in multi], width=0.4, label="topology-blind (random pick)")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{r.name}\n{r.node}" for r in multi], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("estimated all-reduce GB/s")
    ax.set_yscale("log")
    ax.set_title("Where each multi-GPU pod landed: estimated all-reduce bandwidth")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(out_dir: Path, seed: int, pods: int) -> int:
    started = time.monotonic()
    png = out_dir / "demo.png"
    try:  # before the run, so an unwritable --out fails in a second, not after the whole demo
        out_dir.mkdir(parents=True, exist_ok=True)
        png.touch()
    except OSError as e:
        print(f"cannot write the chart to {png}: {e.strerror or e}", file=sys.stderr)
        return 2
    rows, leftovers = run(seed=seed, pods=pods)
    print()
    print(table(rows))
    if chart(rows, png):
        print(f"\nchart: {png}")
    else:
        png.unlink(missing_ok=True)
        print("\nchart skipped: matplotlib is not installed (pip install 'gpu-topology-scheduling[plot]')")
    print(f"finished in {time.monotonic() - started:.1f} s; processes and sockets left behind: "
          f"{', '.join(leftovers) if leftovers else 'none'}")
    bad = [r for r in rows if r.node and not r.plan_honoured]
    return 1 if leftovers or bad else 0
