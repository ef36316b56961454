"""Plays kube-scheduler against an extender over real HTTP, with the request bodies kube-scheduler sends.

The verbs and bodies follow kube-scheduler v1.36 with `nodeCacheCapable: true`: PascalCase keys, `Nodes: null`,
the full Pod JSON; prioritize is skipped when one node is left (as the scheduler does), the highest total score wins
with ties broken at random (seeded), and bind is the extender's (it is the binder).

Which pods reach the extender at all is kube-scheduler's rule (HTTPExtender.IsInterested, k8s.io/kubernetes
pkg/scheduler/extender.go): with a non-empty `managedResources` the extender is asked only about a pod one of whose
containers or init containers names one of those resources, by exact name, in its requests or limits (the count,
zero included, does not matter; `ignoredByScheduler` only makes kube-scheduler skip its own count of that resource,
never the call); with none listed it is asked about every pod. The driver reads the list from the same
configuration the deployment ships (`DEFAULT_CONFIG`: deploy/manifests/second-scheduler/config.yaml, which a test
keeps equal to the chart's default rendering), or from the configuration it is given (`scheduler_config`): a pod the
extender is not asked about is placed by kube-scheduler alone, which the driver plays as a seeded random choice among
the nodes, bound without the extender (Decision.reason says so).
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

RESOURCE = "nvidia.com/gpu"
DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "manifests" / "second-scheduler" / "config.yaml"
SKIPPED = "bound by kube-scheduler without the extender (the pod asks none of its managedResources)"
EVERY_POD: frozenset[str] = frozenset()  # managedResources empty: the extender is asked about every pod


def scheduler_config(source: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """A KubeSchedulerConfiguration: a mapping as is, else the YAML file's (a ConfigMap's `data` entry holding one,
    as deploy/manifests/second-scheduler/config.yaml, is unwrapped)."""
    if isinstance(source, Mapping):
        return dict(source)
    doc = yaml.safe_load(Path(source).read_text())
    if isinstance(doc, dict) and doc.get("kind") == "ConfigMap":
        texts = [t for t in (doc.get("data") or {}).values() if "KubeSchedulerConfiguration" in str(t)]
        if len(texts) != 1:
            raise ValueError(f"{source}: a ConfigMap without exactly one KubeSchedulerConfiguration in its data")
        doc = yaml.safe_load(texts[0])
    if not isinstance(doc, dict) or doc.get("kind") != "KubeSchedulerConfiguration":
        raise ValueError(f"{source}: not a KubeSchedulerConfiguration")
    return doc


def managed_resources(config: Mapping[str, Any]) -> frozenset[str]:
    """The binder extender's managedResources names (EVERY_POD, the empty set, when it lists none)."""
    extenders = [e for e in config.get("extenders") or [] if e.get("bindVerb")] or list(config.get("extenders") or [])
    if not extenders:
        raise ValueError("the configuration has no extender")
    return frozenset(str(m["name"]) for m in extenders[0].get("managedResources") or [])


def default_managed_resources() -> frozenset[str]:
    """What the shipped second-scheduler configuration lists (DEFAULT_CONFIG). Where the repository's deploy/ is not
    beside the package (an installed wheel), the same names from their source: the resource and NVIDIA's shared name
    of it (renameByDefault: `<name>.shared`), then every mixed-strategy MIG name and its shared name."""
    if DEFAULT_CONFIG.is_file():
        return managed_resources(scheduler_config(DEFAULT_CONFIG))
    from gputopo.contract import mig_resource_suffixes

    domain = RESOURCE.split("/", 1)[0]
    migs = [f"{domain}/{s}" for s in mig_resource_suffixes()]
    return frozenset([RESOURCE, f"{RESOURCE}.shared", *migs, *(f"{m}.shared" for m in migs)])


def interested(pod: Mapping[str, Any], managed: Collection[str]) -> bool:
    """kube-scheduler's HTTPExtender.IsInterested: True when `managed` is empty, else when a container or init
    container names one of `managed` in its requests or limits."""
    if not managed:
        return True
    spec = pod.get("spec") or {}
    for c in [*(spec.get("containers") or []), *(spec.get("initContainers") or [])]:
        res = c.get("resources") or {}
        if any(name in managed for part in ("requests", "limits") for name in res.get(part) or {}):
            return True
    return False


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
    def __init__(self, base_url: str, seed: int = 0, timeout_s: float = 5.0,
                 config: str | Path | Mapping[str, Any] | None = None) -> None:
        """`config`: the KubeSchedulerConfiguration whose managedResources decide which pods reach the extender
        (a path or a mapping); None: the shipped one (DEFAULT_CONFIG)."""
        self.client = httpx.Client(base_url=base_url, timeout=timeout_s)
        self.rng = random.Random(seed)
        self.managed = default_managed_resources() if config is None else managed_resources(scheduler_config(config))

    def close(self) -> None:
        self.client.close()

    def _post(self, verb: str, body: dict) -> object:
        r = self.client.post(f"/{verb}", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"/{verb} answered HTTP {r.status_code}: {r.text[:300]}")
        return r.json()

    def schedule(self, pod: dict, node_names: Sequence[str]) -> Decision:
        if not interested(pod, self.managed):
            node = self.rng.choice(sorted(node_names)) if node_names else None
            return Decision(node, SKIPPED if node is not None else "no node", {})
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
