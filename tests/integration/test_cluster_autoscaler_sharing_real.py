"""The REAL Cluster Autoscaler 1.31.5 and shared GPUs: node groups of a time-sliced HGX H100 4-GPU server whose
replicas are renamed (`nvidia.com/gpu.shared`, renameByDefault), over the real kube-apiserver and kube-scheduler,
our extender, the chart's second scheduler and our webhook (built like test_cluster_autoscaler_real.py; its cloud
is sim.ca_provider, each group's template from `gpuplugin node-template --sharing-config`).

Groups (each with a `pool` label its pods select, so the cases do not share nodes):
- `strict` (failRequestsGreaterThanOne: true) and `loose` (false), pool `a`, no GPU label;
- `labelled`: as `loose`, pool `b`, WITH the provider's GPU label (renamed replicas advertise no `nvidia.com/gpu`);
- `pair`: 2 replicas per GPU, pool `c`, no GPU label.

CA knows nothing of the extender: what it does is decided by the pod spec (resources, the webhook's node affinity)
and the nodes' labels. The cases run in order on one CA (module scope). Skips, naming why, without
shared/autoscaler, shared/kube or etcd."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gputopo.contract import DEFAULT_KEYS, replica_parent
from sim.ca_provider import DEFAULT_GPU_LABEL, NodeGroupSpec, parse_provider_id
from tests.extender.conftest import H100X4
from tests.helpers.autoscaler import Autoscaler, product_for_ca, running_autoscaler
from tests.helpers.controlplane import ControlPlane

pytestmark = [pytest.mark.timeout(420)]

NS = "ca-sharing"
SHARED = "nvidia.com/gpu.shared"
SCHEDULER = "gpu-topology-scheduler"
POOL = "gpu-topology-sim/pool"
ONE = DEFAULT_KEYS.one_replica_label(SHARED) or ""
FREE = DEFAULT_KEYS.free_gpus_label(SHARED) or ""
SCALE_UP_S = 120.0  # CA loops + a node starting, on a loaded 2-core machine
SCALE_DOWN_S = 120.0  # 15 s unneeded + loops + the node stopping
UNREADY_WINDOW_S = 60.0  # four times --scale-down-unneeded-time: an empty node of the other groups is gone by then


def _config(replicas: int, fail: bool) -> str:
    return ("version: v1\nsharing:\n  timeSlicing:\n    renameByDefault: true\n"
            f"    failRequestsGreaterThanOne: {str(fail).lower()}\n    resources:\n"
            f"    - name: nvidia.com/gpu\n      replicas: {replicas}\n")


def _groups(root: Path) -> tuple[NodeGroupSpec, ...]:
    configs = {"strict": _config(4, True), "loose": _config(4, False), "pair": _config(2, False)}
    for name, text in configs.items():
        (root / f"{name}.yaml").write_text(text)
    return (NodeGroupSpec("strict", H100X4, 0, 2, sharing_config=root / "strict.yaml", gpu_label=False,
                          labels=((POOL, "a"),)),
            NodeGroupSpec("loose", H100X4, 0, 2, sharing_config=root / "loose.yaml", gpu_label=False,
                          labels=((POOL, "a"),)),
            NodeGroupSpec("labelled", H100X4, 0, 2, gpu_type="h100", sharing_config=root / "loose.yaml",
                          gpu_label=True, labels=((POOL, "b"),)),
            NodeGroupSpec("pair", H100X4, 0, 2, sharing_config=root / "pair.yaml", gpu_label=False,
                          labels=((POOL, "c"),)))


@pytest.fixture(scope="module")
def ca(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Autoscaler]:
    groups = _groups(tmp_path_factory.mktemp("sharing-configs"))
    with product_for_ca(request, tmp_path_factory, NS) as (cp, binary), \
            running_autoscaler(cp, binary, groups) as autoscaler:
        yield autoscaler


def _pods(cp: ControlPlane) -> list[str]:
    return [p["metadata"]["name"] for p in cp.list_items(f"/api/v1/namespaces/{NS}/pods")]


def _pod(name: str, replicas: int, selector: dict[str, str], *, old_webhook: bool = False) -> dict[str, Any]:
    """A pod whose one container asks `replicas` of nvidia.com/gpu.shared. `old_webhook`: what the webhook made of
    it before this change, no node affinity (the pod names our scheduler and opts out of the webhook)."""
    meta: dict[str, Any] = {"name": name}
    spec: dict[str, Any] = {"terminationGracePeriodSeconds": 0, "nodeSelector": dict(selector), "containers": [{
        "name": "infer", "image": "registry.invalid/none:0", "resources": {"limits": {SHARED: str(replicas)}}}]}
    if old_webhook:
        meta["labels"] = {DEFAULT_KEYS.webhook: "disabled"}
        spec["schedulerName"] = SCHEDULER
    return {"metadata": meta, "spec": spec}


def _get(cp: ControlPlane, name: str) -> dict[str, Any]:
    return cp.request("GET", f"/api/v1/namespaces/{NS}/pods/{name}")  # type: ignore[no-any-return]


def _create(cp: ControlPlane, pod: dict[str, Any]) -> dict[str, Any]:
    cp.request("POST", f"/api/v1/namespaces/{NS}/pods", pod)
    return _get(cp, pod["metadata"]["name"])


def _delete(cp: ControlPlane, *names: str) -> None:
    for name in names:
        cp.request("DELETE", f"/api/v1/namespaces/{NS}/pods/{name}", ok=(200, 202, 404), gracePeriodSeconds=0)


def _nodes_of(cp: ControlPlane) -> dict[str, str]:
    """Node name -> the group its providerID names."""
    out = {}
    for n in cp.list_items("/api/v1/nodes"):
        parsed = parse_provider_id((n.get("spec") or {}).get("providerID") or "")
        if parsed:
            out[n["metadata"]["name"]] = parsed[0]
    return out


def _node_labels(cp: ControlPlane, name: str) -> dict[str, str]:
    return cp.request("GET", f"/api/v1/nodes/{name}")["metadata"].get("labels") or {}  # type: ignore[no-any-return]


def _bound(ca: Autoscaler, name: str, what: str) -> tuple[str, float]:
    """Wait for pod `name` to bind; (its node, seconds since `started` was noted by the caller's clock)."""
    cp = ca.cp
    ca.wait(what, lambda: _get(cp, name)["spec"].get("nodeName"), SCALE_UP_S)
    return str(_get(cp, name)["spec"]["nodeName"]), time.monotonic()


def _plans(log: str) -> list[str]:
    return [line.split("Final scale-up plan: ", 1)[1] for line in log.splitlines() if "Final scale-up plan" in line]


def _replicas_held(ca: Autoscaler, node: str) -> list[str]:
    started = ca.provider.started_nodes()[node]
    (held,) = started.admission.held(SHARED).values()  # type: ignore[attr-defined]
    return list(held)


def test_a_container_asking_two_replicas_gets_a_node_of_the_group_that_allows_it(ca: Autoscaler) -> None:
    """One `strict` node runs (CA adds it from zero for a one-replica pod selecting it). A pod whose one container
    asks `nvidia.com/gpu.shared: 2`, selecting pool `a` (both groups): the strict node advertises 16 replicas, 15
    free, on four GPUs, so every in-tree filter passes there, and the extender refuses it (failRequestsGreaterThanOne).

    Before, that was all CA saw: the pod "can be moved to" the strict node, no node added, the pod pending for
    good; shown here with the webhook's old output (no affinity: the pod names our scheduler and opts out). Now the
    plugin labels the strict node `one-replica-per-container.gpu.shared=true`, node-template puts it on the strict
    template, and the webhook adds `DoesNotExist` on it: CA's simulation refuses the strict node and template, scales
    up `loose`, and the pod binds there through our extender, on two GPUs."""
    cp = ca.cp
    started = time.monotonic()
    _create(cp, _pod("a-one", 1, {POOL: "a", ONE: "true"}))
    strict, at = _bound(ca, "a-one", "the one-replica pod bound")
    assert _nodes_of(cp)[strict] == "strict", _nodes_of(cp)
    print(f"strict node {strict}: the one-replica pod bound {at - started:.1f} s after creation (scale from zero)")
    assert _node_labels(cp, strict).get(ONE) == "true"

    mark = len(ca.log())
    old = _create(cp, _pod("a-old", 2, {POOL: "a"}, old_webhook=True))
    assert "affinity" not in old["spec"]
    ca.wait("CA reads the old pod as fitting the strict node",
            lambda: f"Pod {NS}/a-old can be moved to {strict}" in ca.log()[mark:], SCALE_UP_S)
    assert not _get(cp, "a-old")["spec"].get("nodeName")
    assert _plans(ca.log()[mark:]) == [], "no node added for the old pod"
    _delete(cp, "a-old")

    mark = len(ca.log())
    started = time.monotonic()
    pod = _create(cp, _pod("a-two", 2, {POOL: "a"}))
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert all({"key": ONE, "operator": "DoesNotExist"} in t["matchExpressions"] for t in terms["nodeSelectorTerms"])
    node, at = _bound(ca, "a-two", "the two-replica pod bound")
    assert _nodes_of(cp)[node] == "loose", (node, _nodes_of(cp))
    plans = _plans(ca.log()[mark:])
    assert plans and all(p.startswith("[{loose ") for p in plans), plans
    assert not ca.provider.members("strict")[1:], "no second strict node"
    ca.wait("the pod admitted", lambda: bool(ca.provider.started_nodes()[node].admission  # type: ignore[attr-defined]
                                             .held(SHARED)), SCALE_UP_S)
    assert len({replica_parent(r)[0] for r in _replicas_held(ca, node)}) == 2
    print(f"two-replica pod bound on {node} {at - started:.1f} s after creation")


def test_a_renamed_group_without_the_gpu_label_is_removed_once_empty(ca: Autoscaler) -> None:
    """renameByDefault: the strict and loose nodes advertise only `nvidia.com/gpu.shared` and carry no GPU label, so
    CA counts them as plain nodes (cpu and memory utilisation). Both were added from zero (the case before); with
    their pods deleted they are empty, and CA removes both after --scale-down-unneeded-time."""
    cp = ca.cp
    added = [n for n, g in _nodes_of(cp).items() if g in ("strict", "loose")]
    if not added:
        pytest.skip("the case before left no node")
    started = time.monotonic()
    _delete(cp, *[p for p in _pods(cp) if p.startswith("a-")])
    ca.wait("the strict and loose nodes removed", lambda: not set(added) & set(_nodes_of(cp))
            and not ca.provider.members("strict") and not ca.provider.members("loose"), SCALE_DOWN_S)
    log = ca.log()
    assert all(f'Scale-down: removing empty node "{n}"' in log for n in added), ca.log_tail()
    print(f"{sorted(added)} removed {time.monotonic() - started:.1f} s after their pods were deleted")


def test_with_the_gpu_label_ca_waits_for_gpus_that_never_come(ca: Autoscaler) -> None:
    """The same renamed node WITH the provider's GPU label: CA counts it as a GPU node, and one without
    `nvidia.com/gpu` allocatable as one whose GPUs are not ready yet. Scale from zero still works (the template
    has the replicas); once its pod is gone the empty node is not removed like the others: CA keeps it as
    unready (its own log says so), for longer than the window in which the unlabelled nodes went."""
    cp = ca.cp
    started = time.monotonic()
    _create(cp, _pod("b-one", 1, {POOL: "b"}))
    node, at = _bound(ca, "b-one", "the one-replica pod bound")
    assert _nodes_of(cp)[node] == "labelled" and _node_labels(cp, node).get(DEFAULT_GPU_LABEL) == "h100"
    bound_after = at - started
    members = ca.provider.members("labelled")
    mark = len(ca.log())
    gone = time.monotonic()
    _delete(cp, "b-one")
    ca.wait("CA's verdicts on the empty labelled node", lambda: ca.log()[mark:].count(node) >= 8, SCALE_DOWN_S)
    deadline = gone + UNREADY_WINDOW_S
    ca.wait("the window", lambda: time.monotonic() >= deadline or node not in _nodes_of(cp), UNREADY_WINDOW_S + 30)
    log = ca.log()[mark:]
    verdicts = sorted({line.split("] ", 1)[-1][:160] for line in log.splitlines() if node in line})
    print(f"labelled node {node}: bound {bound_after:.1f} s after creation; members {members} -> "
          f"{ca.provider.members('labelled')}; CA on it:\n" + "\n".join(verdicts[:30]))
    assert node in _nodes_of(cp), "removed within the window: update the docs"
    assert f'removing empty node "{node}"' not in log
    assert re.search(r"unready", log, re.IGNORECASE), verdicts


def test_two_replicas_on_one_gpu_read_to_the_real_ca_as_needing_a_node(ca: Autoscaler) -> None:
    """The real-CA twin of test_autoscaling_real.py's model case: `pair` nodes have 4 GPUs x 2 replicas. Six
    one-replica pods (CA adds one node for all six) fill three GPUs (the extender packs); 2 replicas stay free, on one
    GPU, and the plugin's `free-gpus` label says 1. A two-replica pod: the webhook's `free-gpus Gt 1` makes CA's
    simulation refuse the node (the replica count alone would fit), the template fits, CA adds a second `pair` node,
    and the pod binds there with its replicas on two GPUs."""
    cp = ca.cp
    names = [f"c-one-{i}" for i in range(6)]
    started = time.monotonic()
    for name in names:
        _create(cp, _pod(name, 1, {POOL: "c"}))
    ca.wait("the six bound", lambda: all(_get(cp, n)["spec"].get("nodeName") for n in names), SCALE_UP_S)
    (first,) = {_get(cp, n)["spec"]["nodeName"] for n in names}
    print(f"six one-replica pods bound on {first} {time.monotonic() - started:.1f} s after creation")
    ca.wait("one GPU with a free replica, published", lambda: _node_labels(cp, first).get(FREE) == "1", SCALE_UP_S)
    mark = len(ca.log())
    started = time.monotonic()
    pod = _create(cp, _pod("c-two", 2, {POOL: "c"}))
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert {"key": FREE, "operator": "Gt", "values": ["1"]} in terms["nodeSelectorTerms"][1]["matchExpressions"]
    node, at = _bound(ca, "c-two", "the two-replica pod bound")
    assert node != first and _nodes_of(cp)[node] == "pair", (node, _nodes_of(cp))
    plans = _plans(ca.log()[mark:])
    assert plans and all(p.startswith("[{pair 1->2 ") for p in plans), plans
    ca.wait("the pod admitted", lambda: bool(ca.provider.started_nodes()[node].admission  # type: ignore[attr-defined]
                                             .held(SHARED)), SCALE_UP_S)
    assert len({replica_parent(r)[0] for r in _replicas_held(ca, node)}) == 2
    print(f"two-replica pod bound on {node} {at - started:.1f} s after creation")
    _delete(cp, "c-two", *names)
