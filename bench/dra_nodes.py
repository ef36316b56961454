"""Does the real kube-scheduler pick the DRA node whose best free GPU set is best? With and without the extender.

A real control plane (tests/helpers/controlplane.py: etcd, kube-apiserver, kube-controller-manager making claims from
templates, kube-scheduler v1.36.2) and DRA nodes of different topologies, each with our driver's real slice
publisher (gpuplugin.dra.publisher.SlicePublisher, run here: it republishes the order as the scheduler writes
allocations, as on a node). One seeded stream of pods, one at a time, each waiting for its claim's allocation: 1-,
2-, 4- and 8-GPU pods, half through the claim templates (`one-gpu`, `best-N-gpus`), half asking `nvidia.com/gpu: N`
(the DeviceClass's extendedResourceName), the oldest deleted when the cluster is full enough (churn). Rounds alternate
extender off (plain kube-scheduler) and on (the two stanzas of tests/helpers/dra_nodes.dra_stanzas), each from an
empty cluster on the same stream. The device-plugin path runs the same stream on device-plugin nodes of the same
topologies through the extender (every pod asking `nvidia.com/gpu: N`, the GPUs read from the plan annotation).

Per multi-GPU pod, from the allocations just before it: each node's best free set for its size by the core allocator
(gputopo.core.best_subset); "missed" when the chosen node's best is below the best node's (0.1 % tolerance);
efficiency = the GB/s of the set given / the best node's best set.

    python -m bench.dra_nodes [--rounds 4] [--pods 40] [--seed 7] [--no-device-plugin]

Writes bench/results/dra-nodes.md, .json and .png. Exits 0 with a message where the Kubernetes binaries
(shared/kube beside the clone) or etcd are absent.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import RESULTS, machine_line, markdown_table
from gpuplugin.dra.pool import PoolPlanner
from gpuplugin.dra.publisher import SlicePublisher
from gputopo.contract import DEFAULT_KEYS, parse_plan
from gputopo.core import Topology, allreduce_gbps, best_subset
from gputopo.discovery.loader import load_topology_file
from gputopo.kube import make_api_client
from gputopo.logs import configure_logging
from tests.helpers.controlplane import ControlPlane, skip_reason
from tests.helpers.dra_nodes import (
    DRA,
    DRIVER,
    TAINT,
    add_dra_node,
    allocated_gpus,
    claim_of,
    dra_stanzas,
    install_classes,
    plain_pod,
    template_pod,
)

TOPOLOGIES = Path(__file__).resolve().parents[1] / "fixtures" / "topologies"
# (node name, fixture): hybrid cube-mesh, NVSwitch, 4-GPU NVLink and PCIe-bridge machines: the best 4-GPU set of
# each ranges from 17 to 371 GB/s
NODES = (
    ("n1-dgx1", "dgx1-v100-ucxpy.txt"),
    ("n2-pcie-a100", "pcie-8x-a100-nv12-bridge-pairs-2socket-nccltests178.txt"),
    ("n3-h100x4", "hgx-h100-4gpu-nv6-nccl1617.txt"),
    ("n4-a100", "hgx-a100-8gpu-epyc7763-pleiades.txt"),
    ("n5-dgx1", "v100-sxm2-8gpu-hybridmesh-lmdeploy4423.txt"),
    ("n6-p5", "aws-p5.48xlarge.txt"),
)
SIZES = ((1, 0.3), (2, 0.3), (4, 0.25), (8, 0.15))
LOAD = 0.7  # delete the oldest pods while more than this share of the GPUs is held before a new pod
NAMESPACE = "dra-nodes"
WAIT_S = 60.0
TOL = 0.999


@dataclass
class Pick:
    round: int
    mode: str  # "off", "on", "device-plugin"
    kind: str  # "template" or "plain"
    size: int
    node: str
    gbps: float
    best_gbps: float
    node_best_gbps: float

    @property
    def missed(self) -> bool:
        return self.node_best_gbps < TOL * self.best_gbps

    @property
    def efficiency(self) -> float:
        return self.gbps / self.best_gbps if self.best_gbps > 0 else 1.0


@dataclass
class Result:
    picks: list[Pick] = field(default_factory=list)
    skipped: int = 0


def stream(seed: int, n: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    sizes, weights = zip(*SIZES, strict=True)
    return [(rng.choice(("template", "plain")), rng.choices(sizes, weights)[0]) for _ in range(n)]


class Cluster:
    """One group of nodes (DRA or device-plugin) on the control plane, and what its pods hold."""

    def __init__(self, cp: ControlPlane, group: str, topos: dict[str, Topology]) -> None:
        self.cp = cp
        self.group = group
        self.topos = topos
        self.held: dict[str, tuple[str, tuple[int, ...]]] = {}  # pod -> (node, GPUs), oldest first

    def free(self) -> dict[str, set[int]]:
        out = {n: set(range(t.size)) for n, t in self.topos.items()}
        for node, gpus in self.held.values():
            out[node] -= set(gpus)
        return out

    def best(self, size: int) -> dict[str, float]:
        out = {}
        for node, free in self.free().items():
            if len(free) >= size:
                out[node] = 0.0 if size < 2 else best_subset(self.topos[node], free, size).allreduce_gbps
        return out

    def load(self) -> float:
        return sum(len(g) for _, g in self.held.values()) / sum(t.size for t in self.topos.values())

    def delete(self, pod: str) -> None:
        self.cp.request("DELETE", f"/api/v1/namespaces/{NAMESPACE}/pods/{pod}", ok=(200, 404), gracePeriodSeconds=0)
        self.held.pop(pod, None)

    def settle(self) -> None:
        """Every claim of a deleted pod gone (the garbage collector), and a moment for the publishers' order."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            owners = {o.get("name") for c in self.cp.list_items(f"{DRA}/namespaces/{NAMESPACE}/resourceclaims")
                      for o in c["metadata"].get("ownerReferences", [])}
            if owners <= set(self.held):
                break
            time.sleep(0.1)
        time.sleep(0.5)

    def clear(self) -> None:
        for pod in list(self.held):
            self.delete(pod)
        self.settle()


def placed_dra(cp: ControlPlane, name: str) -> tuple[str, tuple[int, ...]] | None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        claim = claim_of(cp, NAMESPACE, name)
        got = allocated_gpus(claim) if claim is not None else None
        if got is not None:
            pod = cp.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
            if pod["spec"].get("nodeName"):
                return got
        time.sleep(0.05)
    return None


def placed_plugin(cp: ControlPlane, name: str, topos: dict[str, Topology]) -> tuple[str, tuple[int, ...]] | None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        pod = cp.request("GET", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}")
        text = (pod["metadata"].get("annotations") or {}).get(DEFAULT_KEYS.plan)
        if pod["spec"].get("nodeName") and text:
            plan = parse_plan(text)
            ids = topos[plan.node].ids
            return plan.node, tuple(sorted(ids.index(i) for i in plan.ids))
        time.sleep(0.05)
    return None


def run_stream(cl: Cluster, pods: list[tuple[str, int]], mode: str, rnd: int, out: Result) -> None:
    for i, (kind, size) in enumerate(pods):
        if mode == "device-plugin":
            kind = "plain"
        while cl.held and (cl.load() > LOAD or not cl.best(size)):
            cl.delete(next(iter(cl.held)))
            cl.settle()
        best = cl.best(size)
        if not best:
            out.skipped += 1
            continue
        name = f"r{rnd}-{mode}-{i}-{kind}-{size}"
        body = template_pod(name, size) if kind == "template" else plain_pod(name, size)
        body["spec"]["nodeSelector"] = {"bench-group": cl.group}
        cl.cp.request("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", body)
        got = placed_plugin(cl.cp, name, cl.topos) if mode == "device-plugin" else placed_dra(cl.cp, name)
        if got is None:
            print(f"  {name}: not placed within {WAIT_S:.0f} s, skipped", file=sys.stderr)
            cl.delete(name)
            out.skipped += 1
            continue
        node, gpus = got
        cl.held[name] = (node, gpus)
        if mode != "device-plugin":
            time.sleep(0.3)  # the publisher's republish of this allocation (sequential pods, not a burst)
        if size < 2:
            continue
        top = max(best.values())
        out.picks.append(Pick(rnd, mode, kind, size, node, allreduce_gbps(cl.topos[node], gpus), top,
                              best.get(node, 0.0)))


def summary(picks: list[Pick]) -> dict[str, Any]:
    return {"pods": len(picks), "missed": sum(p.missed for p in picks),
            "miss_share": (sum(p.missed for p in picks) / len(picks)) if picks else 0.0,
            "mean_efficiency": statistics.fmean(p.efficiency for p in picks) if picks else 1.0,
            "min_efficiency": min((p.efficiency for p in picks), default=1.0)}


def table(res: Result) -> tuple[str, dict[str, Any]]:
    rows, data = [], {}
    for mode in ("off", "on", "device-plugin"):
        for kind in ("template", "plain", "all"):
            picks = [p for p in res.picks if p.mode == mode and (kind == "all" or p.kind == kind)]
            if not picks:
                continue
            s = summary(picks)
            data[f"{mode}/{kind}"] = s
            rows.append([mode, kind, s["pods"], s["missed"], f"{100 * s['miss_share']:.1f} %",
                         f"{s['mean_efficiency']:.3f}", f"{s['min_efficiency']:.3f}"])
    header = ["extender", "request", "multi-GPU choices", "missed the best node", "miss share", "mean efficiency",
              "worst"]
    return markdown_table(header, rows), data


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in data if not k.endswith("/all")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [k.replace("/", "\n") for k in keys]
    axes[0].bar(labels, [100 * data[k]["miss_share"] for k in keys], color="tab:red")
    axes[0].set_ylabel("multi-GPU choices missing the best node (%)")
    axes[0].axhline(2.0, color="k", lw=0.8, ls="--")
    axes[1].bar(labels, [data[k]["mean_efficiency"] for k in keys], color="tab:blue")
    axes[1].set_ylabel("mean efficiency vs the best node's set")
    axes[1].set_ylim(0, 1.05)
    fig.suptitle("DRA nodes through the real kube-scheduler v1.36.2: extender off / on, device-plugin path")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="DRA rounds, alternating extender off and on")
    ap.add_argument("--pods", type=int, default=40, help="pods per round")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--no-device-plugin", action="store_true", help="skip the device-plugin path")
    ap.add_argument("--out", type=Path, default=RESULTS / "dra-nodes")
    args = ap.parse_args(argv)
    why = skip_reason()
    if why:
        print(f"bench.dra_nodes skipped: {why}")
        return 0
    configure_logging("warning", sys.stderr, component="bench")
    topos = {n: load_topology_file(TOPOLOGIES / f) for n, f in NODES}
    res = Result()
    started = time.monotonic()
    with ControlPlane(controller_manager=True) as cp:
        install_classes(cp, NAMESPACE)
        api = make_api_client(kubeconfig=str(cp.kubeconfig))
        publishers = []
        for node, topo in topos.items():
            catalog = add_dra_node(cp, node, topo, publish=False)
            cp.patch(f"/api/v1/nodes/{node}", {"metadata": {"labels": {"bench-group": "dra"}}})
            publishers.append(SlicePublisher(api, PoolPlanner(catalog, taint_key=TAINT), lambda: (set(), set()),
                                             driver=DRIVER, node=node, min_interval_s=0.05).start())
        dp_topos = {f"dp-{n}": t for n, t in topos.items()}
        if not args.no_device_plugin:
            for node, topo in dp_topos.items():
                cp.add_gpu_node(node, topo, labels={"bench-group": "dp"})
        ext = cp.start_extender(name="gpu-extender-bench")
        url = f"http://127.0.0.1:{ext.port}"
        time.sleep(2.0)  # the pools published
        pods = stream(args.seed, args.pods)
        dra = Cluster(cp, "dra", topos)
        try:
            for rnd in range(args.rounds):
                mode = "off" if rnd % 2 == 0 else "on"
                sched = cp.start_scheduler(dra_stanzas(url) if mode == "on" else ())
                t0 = time.monotonic()
                run_stream(dra, pods, mode, rnd, res)
                dra.clear()
                cp.stop_scheduler(sched)
                print(f"round {rnd} (extender {mode}): {time.monotonic() - t0:.0f} s", file=sys.stderr)
            if not args.no_device_plugin:
                sched = cp.start_scheduler(dra_stanzas(url))
                dp = Cluster(cp, "dp", dp_topos)
                run_stream(dp, pods, "device-plugin", args.rounds, res)
                dp.clear()
                cp.stop_scheduler(sched)
        finally:
            for p in publishers:
                p.stop()
    text, data = table(res)
    md = "\n".join([
        "# DRA nodes: the best node through the real kube-scheduler (bench/dra_nodes.py)", "",
        f"`python -m bench.dra_nodes --rounds {args.rounds} --pods {args.pods} --seed {args.seed}`"
        f"{' --no-device-plugin' if args.no_device_plugin else ''}; {machine_line()}; "
        f"{time.monotonic() - started:.0f} s.", "",
        "Nodes: " + ", ".join(f"{n} ({f.removesuffix('.txt')})" for n, f in NODES) + ". "
        f"Pods one at a time, sizes {', '.join(f'{s}: {w:.0%}' for s, w in SIZES)}, half claim templates and half "
        f"`nvidia.com/gpu: N`; the oldest deleted while more than {LOAD:.0%} of the GPUs are held. "
        "Rounds alternate extender off and on, each from an empty cluster on the same stream. device-plugin: the "
        "same stream (all `nvidia.com/gpu: N`) on device-plugin nodes of the same topologies through the extender.",
        "",
        "Only multi-GPU pods are counted. Missed: the chosen node's best free set (core allocator) is below the best "
        "node's. Efficiency: GB/s of the set given / the best node's best free set.", "",
        text, "",
        f"Pods skipped (no node could take them, or not placed): {res.skipped}.", ""])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(md)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "summary": data,
         "picks": [asdict(p) | {"missed": p.missed, "efficiency": p.efficiency} for p in res.picks]}, indent=1))
    plot(data, args.out.with_suffix(".png"))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
