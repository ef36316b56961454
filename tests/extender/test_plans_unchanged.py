"""The extender's plans for a fixed, seeded backlog equal the recorded golden ones.

Why: refactors of how a pod's needs are read, of the layers, or of the hot path must not move a single pod. This
drives a few hundred pods of mixed kinds (1/2/4/8 whole GPUs, require-nvlink and min-allreduce-gbps annotations,
several containers with an init container, replicas of shared GPUs, jobs of several pods, a few the cluster cannot
take) through the verbs kube-scheduler calls (filter, prioritize, bind; extender.verbs.Verbs over a standalone
Extender, as kube-scheduler's bodies from tests.helpers.scheduler), picking the best-scored node as kube-scheduler
would (ties to the first node in the request's order), with some pods finishing (released) along the way. The
outcome of each pod (its plan: node, resource and GPU ids per container, or the refusal) is compared with
tests/extender/golden/plans_unchanged.json.

To regenerate the golden deliberately (only when a change of placement is intended, and say so in the commit):

    GOLDEN_REGENERATE=1 .venv/bin/python -m pytest -q tests/extender/test_plans_unchanged.py -p no:cacheprovider

A failure prints the pods whose outcome changed, the golden one beside today's.
"""

from __future__ import annotations

import json
import os
import random
import uuid
from pathlib import Path
from typing import Any

import anyio

from extender.config import ExtenderConfig
from extender.service import Extender
from extender.verbs import Verbs
from tests.extender.conftest import A100, DGX1, H100X4, PCIE, TOPOLOGIES, write_inventory
from tests.helpers.kube import GPU, PREFIX
from tests.helpers.scheduler import bind_body, cache_args, pod_json

GOLDEN = Path(__file__).parent / "golden" / "plans_unchanged.json"
REGENERATE = "GOLDEN_REGENERATE"
SHARED = "nvidia.com/gpu.shared"
SEED = 20261207
PODS = 300
P4D = TOPOLOGIES / "aws-p4d.24xlarge.txt"
V100_HYBRID = TOPOLOGIES / "v100-sxm2-8gpu-hybridmesh-lmdeploy4423.txt"
PAIRS = TOPOLOGIES / "pcie-8x-a100-nv12-bridge-pairs-2socket-nccltests178.txt"


def nodes() -> list[dict[str, Any]]:
    """A fixed set of nodes of real topologies, some already partly used, two sharing GPUs as replicas."""
    out: list[dict[str, Any]] = []
    kinds = [A100, DGX1, PCIE, H100X4, P4D, V100_HYBRID, PAIRS]
    for i in range(21):
        node: dict[str, Any] = {"name": f"node-{i:02d}", "topology": kinds[i % len(kinds)]}
        if i % 5 == 3:
            node["used"] = [1, 2]
        out.append(node)
    share = {"strategy": "time-slicing", "failRequestsGreaterThanOne": False,
             "resources": [{"name": SHARED, "replicas": 4, "devices": [0, 1, 2, 3]}]}
    out.append({"name": "shared-0", "topology": DGX1, "sharing": share})
    out.append({"name": "shared-1", "topology": A100, "sharing": {**share, "failRequestsGreaterThanOne": True}})
    return out


def uid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128)))


def backlog() -> list[dict[str, Any]]:
    """PODS pods of mixed kinds in a seeded order; a job's pods arrive one after another, as a gang does."""
    rng = random.Random(SEED)
    pods: list[dict[str, Any]] = []
    jobs = 0
    while len(pods) < PODS:
        kind = rng.random()
        name = f"p{len(pods):03d}"
        if kind < 0.45:
            gpus = rng.choice([1, 1, 2, 2, 4, 4, 8])
            notes: dict[str, str] = {}
            flavour = rng.random()
            if gpus > 1 and flavour < 0.2:
                notes[f"{PREFIX}/require-nvlink"] = "true"
            elif gpus > 1 and flavour < 0.4:
                notes[f"{PREFIX}/min-allreduce-gbps"] = str(rng.choice([20, 60, 100, 200]))
            pods.append(pod_json(name, gpus, uid=uid(rng), annotations=notes or None))
        elif kind < 0.6:
            containers = [{"name": "main", "gpus": rng.choice([1, 2])}, {"name": "helper", "gpus": 1}]
            init = [{"name": "warm", "gpus": rng.choice([1, 2])}]
            pods.append(pod_json(name, uid=uid(rng), containers=containers, init_containers=init))
        elif kind < 0.8:
            pod = pod_json(name, 0, uid=uid(rng))
            limits = {SHARED: str(rng.choice([1, 1, 2]))}
            pod["spec"]["containers"][0]["resources"] = {"limits": limits, "requests": dict(limits)}
            pods.append(pod)
        elif kind < 0.85 and jobs < 3:
            size, gpus = rng.choice([(2, 4), (4, 2), (2, 8)])
            job = f"job-{jobs}"
            jobs += 1
            notes = {f"{PREFIX}/job": job, f"{PREFIX}/job-size": str(size)}
            pods.extend(pod_json(f"{name}-{job}-{i}", gpus, uid=uid(rng), annotations=notes) for i in range(size))
        elif kind < 0.9:
            pods.append(pod_json(name, 16, uid=uid(rng)))  # no node has 16 GPUs: refused everywhere
        else:
            pod = pod_json(name, 0, uid=uid(rng))
            pod["spec"]["containers"][0]["resources"] = {"limits": {GPU: "1", SHARED: "1"}}  # refused: both kinds
            pods.append(pod)
    return pods


def outcome(verbs: Verbs, ext: Extender, pod: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """filter, prioritize on the passed nodes, bind on the best: the plan bound, or why the pod was not."""
    out = verbs.filter(cache_args(pod, names))
    assert isinstance(out, dict), "plan_in_thread=False answers synchronously"
    if out["Error"]:
        return {"error": out["Error"]}
    passed = out["NodeNames"]
    if not passed:
        return {"failed": len(out["FailedNodes"]), "unresolvable": len(out["FailedAndUnresolvableNodes"])}
    scores = verbs.prioritize(cache_args(pod, passed))
    best = max(scores, key=lambda s: s["Score"])["Host"]  # the first of the best, in the request's order
    err = anyio.run(verbs.bind, bind_body(pod, best))["Error"]
    if err:
        return {"node": best, "bind_error": err}
    plan = ext.plan_of(pod["metadata"]["uid"])
    assert plan is not None
    return {"node": plan.node, "resource": plan.resource, "gbps": plan.gbps,
            "containers": {name: sorted(ids) for name, ids in plan.containers}}


def run_backlog(tmp_path: Path) -> dict[str, Any]:
    inventory = write_inventory(tmp_path / "inventory.yaml", nodes())
    ext = Extender.standalone(inventory, ExtenderConfig())
    assert ext.inventory is not None
    verbs = Verbs(ext, plan_in_thread=False)
    names = [n["name"] for n in nodes()]
    rng = random.Random(SEED + 1)
    results: dict[str, Any] = {}
    bound: list[str] = []
    for pod in backlog():
        name = pod["metadata"]["name"]
        results[name] = outcome(verbs, ext, pod, names)
        if "containers" in results[name]:
            bound.append(pod["metadata"]["uid"])
        if bound and rng.random() < 0.5:  # a pod finishes: its GPUs are free for the rest of the backlog
            assert ext.inventory.release(bound.pop(rng.randrange(len(bound)))) is not None
    return results


def diff(golden: dict[str, Any], today: dict[str, Any]) -> str:
    lines = []
    for name in sorted(set(golden) | set(today)):
        if golden.get(name) != today.get(name):
            lines.append(f"  {name}:\n    golden: {json.dumps(golden.get(name), sort_keys=True)}\n"
                         f"    today:  {json.dumps(today.get(name), sort_keys=True)}")
    return "\n".join(lines)


def test_the_backlog_is_placed_as_the_golden_records(tmp_path: Path) -> None:
    today = run_backlog(tmp_path)
    assert sum("containers" in r for r in today.values()) > PODS // 2, "the backlog should mostly be placed"
    if os.environ.get(REGENERATE):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(today, indent=1, sort_keys=True) + "\n")
    golden = json.loads(GOLDEN.read_text())
    changed = diff(golden, today)
    assert not changed, (f"{len(changed.splitlines()) // 3} pods placed otherwise than the golden "
                         f"({GOLDEN.name}; {REGENERATE}=1 regenerates it, see the module's docstring):\n{changed}")
