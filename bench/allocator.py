"""Allocator quality and latency: `python -m bench.allocator [--quick]`.

Quality: for every shared fixture, every free set (all of them up to 8 GPUs; 10,000 sampled on 16-GPU machines) and
every request size >= 2, the efficiency vs the free set (gputopo.core.efficiency: the chosen subset's all-reduce
estimate / the best any subset of that free set reaches) of this allocator next to three baselines: random order
(the kubelet without a preference: the mean over all subsets), lowest index first, and maximum sum of pairwise
bandwidth over all combinations (what two peer projects do). The best is found by an independent brute-force oracle
written here in plain Python (every subset, every threshold), not by the allocator's search.

Latency: cold (every memo cleared before the call, per-topology tables included) and memoised calls, p50 and p99,
at 8, 16, 32 and 72 GPUs.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from bench.common import RESULTS, machine_line, markdown_table, percentile, shared_topology_files
from gputopo.core import VS_FREE, Topology, best_subset, efficiency_ratio
from gputopo.core.allocator import clear_memo
from gputopo.core.scoring import ring_at_least, ring_bottleneck_mbps
from gputopo.discovery.loader import load_topology_file
from sim.machines import nvlink_domains, nvswitch_node, pcie_bridge_server

POLICIES = ("ours", "random", "lowest-index", "max-pair-sum")


def oracle_best_ring(bw: Sequence[Sequence[int]], free: Sequence[int], size: int) -> int:
    """Max ring bottleneck over every `size`-subset of `free`, by brute force per threshold."""
    values = sorted({bw[a][b] for a, b in itertools.combinations(free, 2)}, reverse=True)
    for t in values:
        for combo in itertools.combinations(free, size):
            if all(sum(1 for b in combo if b != a and bw[a][b] >= t) >= 2 for a in combo) and ring_at_least(
                bw, combo, t
            ):
                return t
    return values[-1]


@dataclass
class Tally:
    cases: int = 0
    sums: dict[str, float] | None = None
    mins: dict[str, float] | None = None
    below: dict[str, int] | None = None

    def add(self, eff: dict[str, float]) -> None:
        if self.sums is None:
            self.sums = dict.fromkeys(POLICIES, 0.0)
            self.mins = dict.fromkeys(POLICIES, 1.0)
            self.below = dict.fromkeys(POLICIES, 0)
        assert self.mins is not None and self.below is not None
        self.cases += 1
        for p, v in eff.items():
            self.sums[p] += v
            self.mins[p] = min(self.mins[p], v)
            self.below[p] += v < 0.9995


def evaluate_case(topo: Topology, free: list[int], size: int) -> dict[str, float]:
    bw = topo.bandwidth_mbps
    best = oracle_best_ring(bw, free, size) if size > 2 else max(bw[a][b] for a, b in itertools.combinations(free, 2))
    combos = list(itertools.combinations(free, size))
    rings = [ring_bottleneck_mbps(bw, c) for c in combos] if len(combos) <= 3000 else None
    if rings is None:
        rng = random.Random(len(free) * 100 + size)
        rings = [ring_bottleneck_mbps(bw, rng.sample(free, size)) for _ in range(500)]
    maxsum = max(combos, key=lambda c: (sum(bw[a][b] for a, b in itertools.combinations(c, 2)), [-x for x in c]))
    ours = best_subset(topo, free, size).allreduce_gbps * 1000
    return {
        "ours": efficiency_ratio(ours, best, size),
        "random": efficiency_ratio(statistics.fmean(rings), best, size),
        "lowest-index": efficiency_ratio(ring_bottleneck_mbps(bw, free[:size]), best, size),
        "max-pair-sum": efficiency_ratio(ring_bottleneck_mbps(bw, list(maxsum)), best, size),
    }


def quality_for(args: tuple[str, Topology, int, int]) -> tuple[str, int, Tally]:
    name, topo, samples, seed = args
    tally = Tally()
    n = topo.size
    if samples == 0:
        cases = [
            (list(free), size)
            for k in range(2, n + 1)
            for free in itertools.combinations(range(n), k)
            for size in range(2, k + 1)
        ]
    else:
        rng = random.Random(seed)
        cases = []
        for _ in range(samples):
            free = sorted(rng.sample(range(n), rng.randint(2, n)))
            cases.append((free, rng.randint(2, min(len(free), 8))))
    for free, size in cases:
        tally.add(evaluate_case(topo, free, size))
    return name, n, tally


def quality(quick: bool) -> list[tuple[str, int, Tally]]:
    jobs: list[tuple[str, Topology, int, int]] = []
    for path in shared_topology_files():
        jobs.append((path.stem, load_topology_file(path), 0, 0))
    big = 300 if quick else 5_000
    jobs.append(("synthetic DGX-2 16x V100 NVSwitch", nvswitch_node(16, 6, 2, model="V100"), big, 1))
    jobs.append(("synthetic 16-GPU PCIe + NVLink bridge pairs", pcie_bridge_server(16), big, 2))
    if quick:
        jobs = jobs[:3] + jobs[-2:]
    with ProcessPoolExecutor(max_workers=2) as pool:
        return list(pool.map(quality_for, jobs))


def latency(quick: bool) -> list[tuple[str, int, float, float, float, float]]:
    from gputopo.discovery.loader import load_topology_file as load

    shared = {p.stem: p for p in shared_topology_files()}
    machines = [
        ("DGX-1 V100 cube-mesh (fixture)", load(shared["dgx1-v100-ucxpy"])),
        ("p5.48xlarge H100 NVSwitch (fixture)", load(shared["aws-p5.48xlarge"])),
        ("8x RTX 5090 PCIe (fixture)", load(shared["pcie-8x-rtx5090-2socket-sglang23020"])),
        ("DGX-2 16x V100 NVSwitch (synthetic)", nvswitch_node(16, 6, 2)),
        ("16-GPU PCIe + bridges (synthetic)", pcie_bridge_server(16)),
        ("32 GPUs, 4 NVSwitch domains (synthetic)", nvlink_domains(32, 8, 18, 4)),
        ("GB200 NVL72 (synthetic)", nvswitch_node(72, 18, 5, numa_nodes=4)),
    ]
    calls = 60 if quick else 400
    rows = []
    for name, topo in machines:
        rng = random.Random(7)
        cold, warm = [], []
        for _ in range(calls):
            n = topo.size
            taken = set(rng.sample(range(n), rng.randint(0, n // 2)))
            free = [i for i in range(n) if i not in taken]
            size = rng.choice([s for s in (1, 2, 4, 8) if s <= len(free)])
            clear_memo()
            t0 = time.perf_counter()
            best_subset(topo, free, size)
            cold.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            best_subset(topo, free, size)
            warm.append(time.perf_counter() - t0)
        rows.append(
            (name, topo.size, percentile(cold, 50) * 1e3, percentile(cold, 99) * 1e3,
             percentile(warm, 50) * 1e6, percentile(warm, 99) * 1e6)
        )
    return rows


def plot(results: list[tuple[str, int, Tally]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r[0] for r in results]
    fig, ax = plt.subplots(figsize=(12, 0.35 * len(names) + 2))
    height = 0.2
    for k, policy in enumerate(POLICIES):
        vals = [r[2].sums[policy] / r[2].cases if r[2].sums else 0 for r in results]
        ax.barh([i + k * height for i in range(len(names))], vals, height=height, label=policy)
    ax.set_yticks([i + 1.5 * height for i in range(len(names))])
    ax.set_yticklabels(names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel(f"mean {VS_FREE} (chosen all-reduce estimate / best on that free set)")
    ax.set_xlim(0, 1.05)
    ax.legend(loc="lower right")
    ax.set_title("Allocator vs baselines, every free set and request size >= 2")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer fixtures and samples (a smoke run)")
    args = parser.parse_args()
    t0 = time.time()
    results = quality(args.quick)
    rows = []
    total = Tally()
    for name, n, tally in results:
        assert tally.sums and tally.mins and tally.below
        rows.append(
            [name, n, tally.cases]
            + [f"{tally.sums[p] / tally.cases:.3f} / {tally.mins[p]:.3f}" for p in POLICIES]
            + [tally.below["ours"]]
        )
        total.cases += tally.cases
    quality_md = markdown_table(
        ["machine", "GPUs", "cases", *[f"{p} mean / min" for p in POLICIES], "ours < 1"], rows
    )
    lat = latency(args.quick)
    lat_md = markdown_table(
        ["machine", "GPUs", "cold p50 ms", "cold p99 ms", "memoised p50 us", "memoised p99 us"],
        [[r[0], r[1], f"{r[2]:.2f}", f"{r[3]:.2f}", f"{r[4]:.1f}", f"{r[5]:.1f}"] for r in lat],
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    png = RESULTS / "allocator.png"
    plot(results, str(png))
    text = (
        f"# Allocator: {VS_FREE} and latency\n\n"
        f"`python -m bench.allocator{' --quick' if args.quick else ''}` on {machine_line()}, "
        f"{total.cases} quality cases, {time.time() - t0:.0f} s.\n\n"
        f"## {VS_FREE.capitalize()} (mean / min over every free set and size >= 2)\n\n"
        f"{quality_md}\n\n![efficiency](allocator.png)\n\n"
        "## Latency per call (cold: all memos cleared before each call)\n\n"
        f"{lat_md}\n"
    )
    if not args.quick:
        (RESULTS / "allocator.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
