"""DRA driver: placement under churn, publication size, republish latency: `python -m bench.dra [--hours H]`.

1. For every shared `nvidia-smi topo -m` fixture, a cluster of 16 such nodes under the arrival stream of
   bench/placement.py (its `trace` and `simulate`, same seed and load; jobs larger than the node are left out).
   Node choice for DRA pods is kube-scheduler's (LeastAllocated, no device-quality score); the device is what the
   documented allocator gives: the first free device of the requested class in published order. Compared:
   (s) claim templates (sets for N > 1, the one-<i> singles of the one-gpu class for 1 GPU), the empty node's
   order forever; (r) the same, order republished after each allocation change;
   (1) N single-GPU devices of the gpu-<i> list (what `nvidia.com/gpu: N` gets through DRAExtendedResource),
   republished order; (x) the extender with plans (policy (c) of bench/placement.py).
2. Objects and bytes of one node's pool for 4, 8 and 16 GPUs.
3. Republish latency: a prepare, then the publisher's sync against the in-process apiserver over HTTP; and an
   allocation written on a claim, until the running publisher (claim watch) has published an order that counts it.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import RESULTS, SHARED, complete_topology_files, machine_line, markdown_table, percentile
from bench.placement import ExtenderPolicy, Job, Node, least_allocated, simulate, summarise, trace
from gpuplugin.dra.catalog import ONE, RINGS, Catalog, set_group
from gpuplugin.dra.ordering import publication_order
from gpuplugin.dra.pool import PoolPlanner
from gpuplugin.dra.slices import slice_object
from gputopo.core import VS_EMPTY, Topology
from gputopo.core.efficiency import DEFINITIONS
from gputopo.discovery.loader import load_topology_file

NODES = 16
POLICIES = ("s: DRA templates, static order", "r: DRA templates, republished",
            "1: DRA singles (nvidia.com/gpu: N)", "x: extender + plans")


@functools.cache
def _catalog(topo: Topology) -> Catalog:
    return Catalog.build(topo)


class DraPolicy:
    """The default scheduler's node choice, then the first free device in the node's published order."""

    def __init__(self, singles: bool, republish: bool) -> None:
        self.singles = singles
        self.republish = republish
        self._orders: dict[tuple[str, frozenset[int]], dict[str, list[str]]] = {}

    def _order(self, node: Node) -> dict[str, list[str]]:
        cat = _catalog(node.topo)
        used = frozenset(range(node.topo.size)) - frozenset(node.free) if self.republish else frozenset()
        key = (node.topo.fingerprint, used)
        if key not in self._orders:
            self._orders[key] = publication_order(cat, used)
        return self._orders[key]

    def __call__(self, nodes: Sequence[Node], job: Job, rng: random.Random) -> tuple[Node, tuple[int, ...]] | None:
        node = least_allocated(nodes, job, rng)
        if node is None:
            return None
        cat = _catalog(node.topo)
        order = self._order(node)
        if self.singles or job.size == 1:
            singles = order[RINGS if self.singles else ONE]
            picked = [cat.devices[n].gpus[0] for n in singles if cat.devices[n].gpus[0] in node.free][: job.size]
            return node, tuple(sorted(picked))
        for name in order.get(set_group(job.size), []):
            if set(cat.devices[name].gpus) <= node.free:
                return node, cat.devices[name].gpus
        return None  # no free set of that size on the chosen node: the pod waits


def placement(hours: float, seed: int, load: float) -> tuple[str, dict[str, dict[str, float]]]:
    rows, results = [], {}
    for path in complete_topology_files():
        kind = path.stem
        topo = load_topology_file(path)
        jobs = [j for j in trace(seed, hours, NODES * topo.size, load) if j.size <= topo.size]
        jobs = [Job(i, j.arrival, j.size, j.duration) for i, j in enumerate(jobs)]
        out = {}
        for name, fn in zip(POLICIES, (lambda: DraPolicy(False, False), lambda: DraPolicy(False, True),
                                       lambda: DraPolicy(True, True), ExtenderPolicy), strict=True):
            s = summarise(simulate({kind: NODES}, fn(), jobs, seed))
            out[name] = {"eff": s.efficiency, "gbps": s.gbps, "frag": s.frag_jobs, "jobs": s.jobs}
        results[kind] = out
        rows.append([kind, topo.size, *(f"{out[p]['eff']:.3f}" for p in POLICIES),
                     *(str(out[p]["frag"]) for p in POLICIES)])
        print(f"  {kind}: " + ", ".join(f"{p[:1]} {out[p]['eff']:.3f}" for p in POLICIES), flush=True)
    table = markdown_table(["fixture", "GPUs", *(f"eff {p.split(':')[0]}" for p in POLICIES),
                            *(f"frag waits {p.split(':')[0]}" for p in POLICIES)], rows)
    return table, results


def publication() -> str:
    from sim.machines import nvswitch_node, pcie_bridge_server

    machines = [("aws-g6e 4x L40S (PCIe)", load_topology_file(SHARED / "topologies" / "aws-g6e.12xlarge-4xL40S.txt")),
                ("DGX-1 8x V100", load_topology_file(SHARED / "topologies" / "dgx1-v100-ucxpy.txt")),
                ("16x NVSwitch (DGX-2 class, synthetic)", nvswitch_node(16, 6, 2)),
                ("16x PCIe + bridge pairs (synthetic)", pcie_bridge_server(16))]
    rows = []
    for label, topo in machines:
        t0 = time.perf_counter()
        cat = Catalog.build(topo)
        build_s = time.perf_counter() - t0
        contents = PoolPlanner(cat, taint_key="gpu-topology.io/unhealthy").wanted()
        objs = [slice_object(c, driver="gpu-topology.io", node="gpu-node-1", generation=1, count=len(contents))
                for c in contents]
        size = sum(len(json.dumps(o, separators=(",", ":"))) for o in objs)
        rows.append([label, topo.size, len(cat.devices), cat.summary().split(": ", 1)[1], len(objs),
                     f"{size / 1024:.1f}", f"{build_s:.2f}"])
    return markdown_table(["node", "GPUs", "devices", "offered", "slices", "KiB (JSON)", "catalog build s"], rows)


def republish_latency(rounds: int) -> str:
    from gpuplugin.dra.driver import ClaimKey
    from gputopo.kube import make_api_client
    from tests.fakes.kubeapi import FakeDraKubeApi
    from tests.gpuplugin.dra.conftest import DRIVER, NODE, make_driver

    with FakeDraKubeApi() as fake, tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        fake.add_node({"metadata": {"name": NODE}})
        api = make_api_client(host=fake.url, timeout_s=5.0)
        driver, publisher = make_driver(api, Path(tmp))
        publisher.sync()
        cat = driver.catalog
        rng = random.Random(7)
        times, modes = [], []
        for i in range(rounds):
            # one-<i> holds its GPU as gpu-<i> does (the same state to republish): draw from one of the two lists
            name = rng.choice([n for n, d in cat.devices.items() if d.size in (1, 2, 4) and d.group != ONE])
            body = {"metadata": {"name": f"c{i}", "namespace": "default"}, "spec": {"devices": {"requests": []}}}
            uid = fake.add_claim(body)["metadata"]["uid"]
            fake.allocate_claim("default", f"c{i}", NODE, [{"request": "r", "driver": DRIVER, "pool": NODE,
                                                             "device": name}])
            key = ClaimKey("default", uid, f"c{i}")
            driver.prepare([key])
            t0 = time.perf_counter()
            before = max(s["spec"]["pool"]["generation"] for s in fake.slices(NODE))
            publisher.sync()
            times.append(time.perf_counter() - t0)
            after = max(s["spec"]["pool"]["generation"] for s in fake.slices(NODE))
            modes.append("generation" if after > before else "in place")
            driver.unprepare([key])
            publisher.sync()
        api.close()
    ms = [t * 1000 for t in times]
    return (f"{rounds} prepares of a random single, pair or quad on a DGX-1 pool, each followed by one sync "
            f"(list + plan + writes over HTTP to the in-process apiserver): p50 {percentile(ms, 50):.1f} ms, "
            f"p99 {percentile(ms, 99):.1f} ms, max {max(ms):.1f} ms; {modes.count('in place')} updated in place "
            f"at the same generation, {modes.count('generation')} rewrote the pool at a new generation; "
            f"{sum(1 for _ in range(0))}".rstrip("; 0") + ".")


def allocation_latency(rounds: int) -> str:
    """From the scheduler's allocation write to a published order that follows it (the driver's claim watch), with
    nothing prepared: how far apart pods must come for each to be offered an order that counts the ones before."""
    from gpuplugin.dra.settings import DraSettings
    from gputopo.kube import make_api_client
    from sim.dra_allocator import pools
    from tests.fakes.kubeapi import FakeDraKubeApi
    from tests.gpuplugin.dra.conftest import DRIVER, NODE, make_driver

    def ring_order() -> list[int]:
        view = pools(fake.slices(NODE))
        if len(view) != 1 or not view[0].usable:
            return []
        return [cat.devices[d["name"]].gpus[0] for d in view[0].devices
                if d["attributes"].get("order") == {"string": "rings"}]

    def follows(held: list[int]) -> bool:
        order = ring_order()
        return bool(order) and set(order[len(order) - len(held):]) == set(held)

    def wait(held: list[int]) -> None:
        deadline = time.monotonic() + 30
        while not follows(held):
            if time.monotonic() > deadline:
                raise SystemExit(f"the published order never followed the allocations {held}")
            time.sleep(0.001)

    with FakeDraKubeApi() as fake, tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        fake.add_node({"metadata": {"name": NODE}})
        api = make_api_client(host=fake.url, timeout_s=5.0)
        _, publisher = make_driver(api, Path(tmp))
        publisher.min_interval_s = DraSettings.model_fields["min_publish_interval_s"].default
        cat = publisher.planner.catalog
        publisher.start()
        rng = random.Random(11)
        times: list[float] = []
        held: list[int] = []
        names: list[str] = []
        try:
            wait(held)
            for i in range(rounds):
                if len(held) == 4:  # the pods end: their claims go, and the order follows again
                    for name in names:
                        fake.delete_claim("default", name)
                    held, names = [], []
                    wait(held)
                    time.sleep(publisher.min_interval_s)
                gpu = rng.choice([g for g in range(cat.topology.size) if g not in held])
                fake.add_claim({"metadata": {"name": f"a{i}", "namespace": "default"},
                                "spec": {"devices": {"requests": []}}})
                t0 = time.perf_counter()
                fake.allocate_claim("default", f"a{i}", NODE, [{"request": "r", "driver": DRIVER, "pool": NODE,
                                                                 "device": f"gpu-{gpu}"}])
                held.append(gpu)
                names.append(f"a{i}")
                wait(held)
                times.append(time.perf_counter() - t0)
                time.sleep(publisher.min_interval_s)
        finally:
            publisher.stop()
            api.close()
    ms = [t * 1000 for t in times]
    return (f"{rounds} allocations of one ring-ordered single on a DGX-1 pool (up to 4 held, then released), "
            f"each written as the scheduler writes it, nothing prepared; from the write to a published order that "
            f"counts it (watch event + sync over HTTP, min publish interval {publisher.min_interval_s:g} s): "
            f"p50 {percentile(ms, 50):.1f} ms, p99 {percentile(ms, 99):.1f} ms, max {max(ms):.1f} ms.")


def plot(results: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(results)
    fig, ax = plt.subplots(figsize=(14, 5))
    width = 0.2
    colours = ["#c44e52", "#dd8452", "#55a868", "#4c72b0"]
    for k, p in enumerate(POLICIES):
        ax.bar([i + (k - 1.5) * width for i in range(len(kinds))], [results[x][p]["eff"] for x in kinds],
               width=width, color=colours[k], label=p)
    ax.set_xticks(range(len(kinds)))
    ax.set_xticklabels([k[:22] for k in kinds], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(f"mean {VS_EMPTY} (multi-GPU jobs)")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hours", type=float, default=12.0)
    parser.add_argument("--seed", type=int, default=20261130)
    parser.add_argument("--load", type=float, default=0.95)
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args()
    started = time.time()
    table, results = placement(args.hours, args.seed, args.load)
    pub = publication()
    lat = republish_latency(args.rounds)
    alloc = allocation_latency(args.rounds)
    means = {p: statistics.fmean(results[k][p]["eff"] for k in results) for p in POLICIES}
    text = [
        "# DRA driver: placement under churn, publication, republish latency\n",
        f"`python -m bench.dra --hours {args.hours:g} --seed {args.seed} --load {args.load:g} --rounds "
        f"{args.rounds}` on {machine_line()}.\n",
        f"## Placement efficiency under churn ({NODES} nodes per fixture, arrival stream of bench/placement.py)\n",
        f"Mean {VS_EMPTY} of multi-GPU jobs ({DEFINITIONS[VS_EMPTY]}), and jobs that "
        "waited while enough GPUs were free in the cluster. s: claim templates (a set for N > 1 GPUs, a one-<i> "
        "single of the one-gpu class for 1 GPU), static order; r: the same, republished order; 1: N gpu-<i> "
        "singles in published order for every job (`nvidia.com/gpu: N`); x: the extender with plans.\n",
        table,
        "\nMean over fixtures: " + ", ".join(f"{p.split(':')[0]} {v:.3f}" for p, v in means.items()) + ".\n",
        "\n## One node's pool\n", pub,
        "\n## Republish latency after a prepare\n", lat,
        "\n\n## Republish latency after an allocation, before its prepare\n", alloc,
        f"\n\n![dra](dra.png)\n\nRun time {time.time() - started:.0f} s.\n",
    ]
    RESULTS.mkdir(parents=True, exist_ok=True)
    plot(results, RESULTS / "dra.png")
    (RESULTS / "dra.md").write_text("\n".join(text))
    print("\n".join(text))


if __name__ == "__main__":
    main()
