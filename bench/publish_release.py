"""Release latency of the plugin's Node state: `python -m bench.publish_release [--cycles C]`.

`gpuplugin run` as a process (tests.fakes.gpunode: the in-process kube-apiserver, the kubelet simulator, the
PodResources fake on its unix socket). Each cycle puts four 2-GPU pods on a DGX-1 (in the API and in PodResources),
waits until the Node's state annotation lists them used, then force-deletes them one by one as `kubectl delete
--force --grace-period=0` does: the pod leaves the API at once, the kubelet lets go of its devices `lag` seconds
later (0 to 0.6 s, cycled). Measured per pod: from the moment PodResources stops listing it to the moment the Node's
annotation shows its GPUs free (what the extender and the scheduler read). Also printed: Node PATCHes and
PodResources List calls per pod, the load the promptness costs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from bench.common import SHARED, machine_line, percentile
from gputopo.core import state_from_json
from tests.fakes.gpunode import GpuNode, gpu_node
from tests.helpers.kube import k8s_pod

NODE = "bench-node"
RESOURCE = "nvidia.com/gpu"
PAIRS = (("0", "3"), ("1", "2"), ("4", "7"), ("5", "6"))
LAGS = (0.0, 0.1, 0.3, 0.6)
WAIT_S = 30.0


def _used(node: GpuNode) -> frozenset[str] | None:
    raw = (node.fake.node(NODE) or {}).get("metadata", {}).get("annotations", {}).get("gpu-topology.io/state")
    return state_from_json(raw).used if raw else None


def _wait(node: GpuNode, predicate: Callable[[frozenset[str] | None], bool], what: str) -> float:
    deadline = time.monotonic() + WAIT_S
    while not predicate(_used(node)):
        if time.monotonic() > deadline or node.process.poll() is not None:
            raise SystemExit(f"timed out waiting for {what}:\n{node.log_tail()}")
        time.sleep(0.002)
    return time.monotonic()


def _patches(node: GpuNode) -> int:
    return sum(1 for r in node.fake.requests if r.method == "PATCH" and r.path == f"/api/v1/nodes/{NODE}")


def run(cycles: int) -> tuple[list[float], int, int]:
    latencies: list[float] = []
    with gpu_node(NODE, SHARED / "topologies" / "dgx1-v100-ucxpy.txt",
                  args=["--device-id-strategy", "index"]) as node:
        patches_before = lists_before = 0
        for cycle in range(cycles):
            for k, pair in enumerate(PAIRS):
                node.podres.service.set_pod("default", f"p{cycle}-{k}", {"main": {RESOURCE: list(pair)}})
                node.fake.add_pod(k8s_pod(f"p{cycle}-{k}", 2, NODE, phase="Running"))
            _wait(node, lambda used: used is not None and len(used) == 8, "the pods' GPUs published used")
            time.sleep(1.0)  # the plan watch has seen every pod; no patch is recent
            if cycle == 0:
                patches_before, lists_before = _patches(node), node.podres.service.list_calls
            for k, pair in enumerate(PAIRS):
                lag = LAGS[(cycle + k) % len(LAGS)]
                node.fake.delete_pod("default", f"p{cycle}-{k}")
                time.sleep(lag)
                node.podres.service.remove_pod("default", f"p{cycle}-{k}")
                released = time.monotonic()
                seen = _wait(node, lambda used, pair=pair: used is not None and used.isdisjoint(pair),
                             f"GPUs {pair} published free")
                latencies.append(seen - released)
        patches = _patches(node) - patches_before
        lists = node.podres.service.list_calls - lists_before
    return latencies, patches, lists


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=5)
    args = parser.parse_args()
    latencies, patches, lists = run(args.cycles)
    ms = [x * 1000 for x in latencies]
    releases = len(latencies)
    print(f"`python -m bench.publish_release --cycles {args.cycles}` on {machine_line()}")
    print(f"{releases} releases (force-deleted 2-GPU pods, kubelet lag {'/'.join(f'{x:g}' for x in LAGS)} s): "
          f"from PodResources letting go to the Node showing the GPUs free: p50 {percentile(ms, 50):.0f} ms, "
          f"p90 {percentile(ms, 90):.0f} ms, max {max(ms):.0f} ms; "
          f"{patches / releases:.2f} Node PATCHes and {lists / releases:.1f} PodResources List calls per pod "
          f"(its release and, after the first cycle, its allocation)")


if __name__ == "__main__":
    main()
