"""Scheduler extender latency with jobs present, over real HTTP: `python -m bench.extender_jobs [--nodes N]`.
It predicts what job planning adds to one verb at 5,000 nodes; the per-pod cost behind the real kube-scheduler is
bench.scale's (without jobs).

The extender runs as its own process (`gpu-extender serve --inventory`, standalone, one uvicorn worker) on N nodes
(default 5,000) in racks of 32 (8 racks a spine, labelled as NVIDIA topograph labels them), each rack one machine
kind of the shared topology fixtures, 40% of the nodes empty and the rest with a random set of GPUs in use (seeded).
The client is a separate process speaking HTTP/1.1 keep-alive with kube-scheduler's bodies (nodeCacheCapable: every
node's name), encoded before the clock starts; latency is the client-observed round trip.

1. Single pods (1, 2, 4, 8 GPUs) before any job: filter + prioritize p50 / p99 (the baseline of bench.extender).
2. Job planning through the verbs: the first pod's filter of fresh 32-pod jobs (`gpu-topology.io/job` and
   `job-size` annotations) of 1, 2, 4 and 8 GPUs per pod: it plans the whole job on every node and reserves every
   slot. The jobs stay reserved: the cluster fills with plans.
3. Single pods again, with those jobs' slots reserved across the cluster.
4. Later pods of those jobs: filter + prioritize (a lookup of the job's open slots, then the answer for every node).

Round trips on a shared 2-core machine carry the other work's scheduling delays, so the same four series are also
run in the benchmark's own process: the verbs' code on the same inventory, body
decoding and answer encoding included, HTTP and uvicorn left out, timed in CPU time of the calling thread, which
other processes do not inflate.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from pathlib import Path
from typing import Any

import orjson
import yaml

from bench.common import RESULTS, machine_line, markdown_table, percentile, scratch, shared_topology_files
from bench.extender import Client, Server, args_body, ms, pod_json, verb_latency
from extender.service import Extender
from extender.state.pods import pod_needs
from extender.verbs import Verbs
from gputopo.discovery.loader import load_topology_file

SIZES = (1, 2, 4, 8)
NODES_PER_RACK = 32
RACKS_PER_SPINE = 8
PREFIX = "gpu-topology.io"


def make_inventory(path: Path, n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    files = [f for f in shared_topology_files() if load_topology_file(f).size >= 4]
    ids = {f: load_topology_file(f).ids for f in files}
    nodes = []
    for i in range(n):
        rack = i // NODES_PER_RACK
        f = files[rack % len(files)]
        used = [] if rng.random() < 0.4 else rng.sample(list(ids[f]), rng.randint(1, len(ids[f])))
        nodes.append({"name": f"node-{i:05d}", "topology": str(f), "used": used,
                      "labels": {"network.topology.nvidia.com/leaf": f"r{rack}",
                                 "network.topology.nvidia.com/spine": f"s{rack // RACKS_PER_SPINE}"}})
    path.write_text(yaml.safe_dump({"nodes": nodes}, width=1000))
    return [nd["name"] for nd in nodes]


def job_pod(job: str, index: int, gpus: int, pods: int) -> dict[str, Any]:
    pod = pod_json(gpus, f"{job}-{index}", f"{job}-{index}")
    pod["metadata"]["annotations"] = {f"{PREFIX}/job": job, f"{PREFIX}/job-size": str(pods)}
    return pod


def verbs(c: Client | InProcess, body: bytes) -> tuple[float, float, dict[str, Any]]:
    df, data = c.timed("/filter", body)
    out = json.loads(data)
    dp, _ = c.timed("/prioritize", body)
    return df, dp, out


class InProcess:
    """The verbs' code without HTTP, timed in thread CPU time: the same calls as Client.timed makes."""

    def __init__(self, inventory: Path) -> None:
        self.verbs = Verbs(Extender.standalone(inventory), plan_in_thread=False)  # timed in this thread

    def timed(self, path: str, body: bytes) -> tuple[float, bytes]:
        gc.disable()  # as extender.http.answers does around a verb
        try:
            t0 = time.thread_time()
            data = orjson.loads(body)
            answer = self.verbs.filter(data) if path == "/filter" else self.verbs.prioritize(data)
            out = answer if isinstance(answer, bytes) else orjson.dumps(answer)
            return time.thread_time() - t0, out
        finally:
            gc.enable()


def job_check_cost(inventory: Path, calls: int = 20_000) -> float:
    """Microseconds of thread CPU time the verbs spend per single pod to learn it belongs to no job."""
    ext = Extender.standalone(inventory)
    pod = pod_json(4, "single-4", "single-4")
    needs = pod_needs(pod, ext.config.resource_name, ext.config.keys)
    t0 = time.thread_time()
    for _ in range(calls):
        ext.jobs.pod_of(pod, needs)
    return (time.thread_time() - t0) / calls * 1e6


def series(c: Client | InProcess, names: list[str], rounds: int, jobs_per_size: int) -> tuple[list[list[Any]],
                                                                                          list[list[Any]], int]:
    """(filter+prioritize rows, planning rows, jobs planned) for one way of calling the verbs."""
    singles = {s: args_body(pod_json(s, f"single-{s}", f"single-{s}"), names, None) for s in SIZES}
    for _ in range(2):
        for s in SIZES:
            verbs(c, singles[s])
    before = [sum(verbs(c, singles[SIZES[k % 4]])[:2]) for k in range(rounds)]

    plans: dict[int, list[float]] = {k: [] for k in SIZES}
    planned: list[tuple[str, int]] = []
    for round_ in range(jobs_per_size):
        for k in SIZES:
            job = f"bench-{k}gpu-{round_}"
            df, data = c.timed("/filter", args_body(job_pod(job, 0, k, 32), names, None))
            passed = json.loads(data)["NodeNames"]
            plans[k].append(df)
            if passed:
                planned.append((job, k))
    for _ in range(2):  # node states with reserved GPUs are new to the memo: warm it as before the jobs
        for s in SIZES:
            verbs(c, singles[s])
    with_jobs = [sum(verbs(c, singles[SIZES[k % 4]])[:2]) for k in range(rounds)]
    members = []
    member_bodies = [args_body(job_pod(job, 1 + r % 31, k, 32), names, None)
                     for r, (job, k) in enumerate(planned * (rounds // max(1, len(planned)) + 1))][:rounds]
    for body in member_bodies:
        df, dp, out = verbs(c, body)
        assert out["NodeNames"], "a later pod of a planned job found no slot"
        members.append(df + dp)
    rows = [["single pods, no job yet", len(before), ms(percentile(before, 50)), ms(percentile(before, 99))],
            [f"single pods, {len(planned)} jobs of 32 pods reserved", len(with_jobs),
             ms(percentile(with_jobs, 50)), ms(percentile(with_jobs, 99))],
            ["later pods of those jobs (their slots looked up)", len(members), ms(percentile(members, 50)),
             ms(percentile(members, 99))]]
    plan_rows = [[f"32 x {k} GPUs", len(v), ms(percentile(v, 50)), ms(percentile(v, 99)), ms(max(v))]
                 for k, v in plans.items()]
    return rows, plan_rows, len(planned)


def run(n: int, rounds: int, jobs_per_size: int, seed: int) -> str:
    tmp = scratch("bench-extender-jobs-")
    load_before = os.getloadavg()[0]
    names = make_inventory(tmp / "inv.yaml", n, seed)
    server = Server(tmp / "inv.yaml")
    try:
        rows, plan_rows, _ = series(server.client(), names, rounds, jobs_per_size)
    finally:
        server.stop()
    cpu_rows, cpu_plan_rows, _ = series(InProcess(tmp / "inv.yaml"), names, rounds, jobs_per_size)
    job_check_us = job_check_cost(tmp / "inv.yaml")
    control = verb_latency(n, "cache", rounds, tmp)  # bench.extender's own series, on its own inventory, now
    rows.append(["control: bench.extender's single-pod series (its inventory, no labels), this run",
                 len(control["both"]), ms(percentile(control["both"], 50)), ms(percentile(control["both"], 99))])
    load = f"{load_before:.2f} before, {os.getloadavg()[0]:.2f} after"
    return "\n".join([
        "# Scheduler extender with jobs: latency",
        "",
        f"Machine: {machine_line()}. Command: `python -m bench.extender_jobs --nodes {n} --rounds {rounds} "
        f"--jobs {jobs_per_size}`. {n:,} nodes in racks of {NODES_PER_RACK} ({RACKS_PER_SPINE} racks a spine), "
        "each rack one machine kind of the shared fixtures (4 GPUs or more), 40% empty, the rest with random GPUs in "
        "use; `gpu-extender serve --inventory` in its own process, the client in another, kube-scheduler's bodies "
        f"with every node's name (nodeCacheCapable). 1-minute load average: {load}.",
        "",
        "## filter + prioritize (client round trip)",
        "",
        "Target: p99 <= 10 ms at 5,000 nodes. A job's later pod is answered from its plan: its open slots pass, "
        "every other node gets the job's one reason. The control row is bench.extender's own series run now: "
        "compare it with bench/results/extender.md to see how much the machine's other work costs this run.",
        "",
        markdown_table(["pods", "requests", "filter+prioritize p50 ms", "filter+prioritize p99 ms"], rows),
        "",
        "## Job planning through the verbs: the first pod's filter of a 32-pod job",
        "",
        "Plans the whole job on every node (extender.jobs.planner) and reserves every slot; the round trip includes "
        "the snapshot of the node cache and the answer for every node. Jobs planned one after another, so the "
        "cluster fills with reserved plans.",
        "",
        markdown_table(["job", "jobs", "p50 ms", "p99 ms", "max ms"], plan_rows),
        "",
        "## The same in the benchmark's process: the verbs' CPU time, no HTTP",
        "",
        "Decoding the body, the verb, encoding the answer; thread CPU time, so waiting for the CPU does not count "
        "(a busy sibling hyperthread still slows it). A fresh extender on the same inventory, the same series in "
        "the same order.",
        "",
        markdown_table(["pods", "requests", "filter+prioritize p50 ms", "filter+prioritize p99 ms"], cpu_rows),
        "",
        markdown_table(["job (first pod's filter)", "jobs", "p50 ms", "p99 ms", "max ms"], cpu_plan_rows),
        "",
        f"What telling a single pod from a job's costs it (`JobPlans.pod_of`, called by filter and by prioritize): "
        f"{job_check_us:.1f} us of CPU per call.",
        "",
    ])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=400, help="filter+prioritize pairs per series")
    parser.add_argument("--jobs", type=int, default=10, help="32-pod jobs planned per GPU count")
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--output", type=Path, default=RESULTS / "extender-jobs.md")
    args = parser.parse_args()
    started = time.time()
    report = run(args.nodes, args.rounds, args.jobs, args.seed)
    report += f"\nRun time {time.time() - started:.0f} s.\n"
    print(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(report)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
