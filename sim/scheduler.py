"""Plays kube-scheduler against an extender over real HTTP, with the request bodies kube-scheduler sends.

The verbs and bodies follow kube-scheduler v1.36 with `nodeCacheCapable: true`: PascalCase keys, `Nodes: null`,
the full Pod JSON; prioritize is skipped when one node is left (as the scheduler does), the highest total score wins
with ties broken at random (seeded), and bind is the extender's (it is the binder).
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

RESOURCE = "nvidia.com/gpu"


def gpu_pod(name: str, gpus: int, *, namespace: str = "default", annotations: dict[str, str] | None = None,
            scheduler_name: str = "gpu-topology-scheduler") -> dict:
    """A pending Pod as kube-scheduler serialises it (the fields it always sends)."""
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": str(uuid.uuid5(uuid.NAMESPACE_URL, f"demo/{namespace}/{name}")),
            "resourceVersion": "1",
            "creationTimestamp": "2026-11-30T00:00:00Z",
            "annotations": annotations or {},
        },
        "spec": {
            "containers": [{
                "name": "main",
                "image": "registry.invalid/trainer:1",
                "resources": {"limits": {RESOURCE: str(gpus)}, "requests": {RESOURCE: str(gpus)}},
            }],
            "schedulerName": scheduler_name,
            "restartPolicy": "Never",
            "priority": 0,
            "preemptionPolicy": "PreemptLowerPriority",
        },
        "status": {"phase": "Pending", "qosClass": "BestEffort"},
    }


@dataclass
class Decision:
    node: str | None
    reason: str
    scores: dict[str, int]


class SchedulerDriver:
    def __init__(self, base_url: str, seed: int = 0, timeout_s: float = 5.0) -> None:
        self.client = httpx.Client(base_url=base_url, timeout=timeout_s)
        self.rng = random.Random(seed)

    def close(self) -> None:
        self.client.close()

    def _post(self, verb: str, body: dict) -> object:
        r = self.client.post(f"/{verb}", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"/{verb} answered HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def schedule(self, pod: dict, node_names: Sequence[str]) -> Decision:
        filtered = self._post("filter", {"Pod": pod, "Nodes": None, "NodeNames": list(node_names)})
        assert isinstance(filtered, dict)
        if filtered.get("Error"):
            return Decision(None, f"filter error: {filtered['Error']}", {})
        feasible = filtered.get("NodeNames") or []
        if not feasible:
            reasons = {**(filtered.get("FailedNodes") or {}), **(filtered.get("FailedAndUnresolvableNodes") or {})}
            first = next(iter(reasons.items()), ("-", "no node"))
            return Decision(None, f"unschedulable ({len(reasons)} nodes refused; {first[0]}: {first[1]})", {})
        scores = {feasible[0]: 0}
        if len(feasible) > 1:
            answer = self._post("prioritize", {"Pod": pod, "Nodes": None, "NodeNames": feasible})
            assert isinstance(answer, list)
            scores = {h["Host"]: int(h["Score"]) for h in answer}
        top = max(scores.values())
        node = self.rng.choice(sorted(n for n, s in scores.items() if s == top))
        meta = pod["metadata"]
        bound = self._post("bind", {"PodName": meta["name"], "PodNamespace": meta["namespace"],
                                    "PodUID": meta["uid"], "Node": node})
        assert isinstance(bound, dict)
        if bound.get("Error"):
            return Decision(None, f"bind error: {bound['Error']}", scores)
        return Decision(node, "bound", scores)

    def inventory(self) -> dict:
        r = self.client.get("/inventory")
        r.raise_for_status()
        return r.json()

    def finish(self, pod: dict) -> None:
        """The pod ended: the standalone extender frees its GPUs."""
        r = self.client.delete(f"/inventory/pods/{pod['metadata']['uid']}")
        r.raise_for_status()
