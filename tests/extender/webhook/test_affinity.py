"""A pod's require-nvlink and min-allreduce-gbps reach node autoscalers as required node affinity on the plugin's
node labels: through the webhook's rule on the recorded kube-apiserver review, the stored pod being what the patch
makes of it. Node affinity's semantics (terms ORed, expressions ANDed) are checked on the patched pod: a node
matches it exactly when it matched before and satisfies the constraints."""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from extender.webhook import review
from gputopo.contract import DEFAULT_KEYS, NVLINK_FABRICS
from tests.extender.webhook.recordings import SCHEDULER, apply_patch, decoded_patch, pod_of
from tests.extender.webhook.recordings import review as recorded

POLICY = review.Policy(SCHEDULER, "nvidia.com/gpu", "gpu-topology.io/webhook")
NVLINK = {"key": DEFAULT_KEYS.fabric_label, "operator": "In", "values": list(NVLINK_FABRICS)}


def ring(size: int) -> dict[str, Any]:
    """The empty node's `size` GPUs can ring on NVLink alone, or the node does not say (a plugin before the label)."""
    return {"key": DEFAULT_KEYS.nvlink_ring_label(size), "operator": "NotIn", "values": ["false"]}

REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


def _gpus(request: dict[str, Any], n: int) -> None:
    res = request["object"]["spec"]["containers"][0]["resources"]
    for part in res.values():
        part["nvidia.com/gpu"] = str(n)


def _review(gpus: int = 4, annotations: dict[str, str] | None = None, affinity: Any = None,
            scheduler: str | None = None) -> dict[str, Any]:
    def change(request: dict[str, Any]) -> None:
        _gpus(request, gpus)
        request["object"]["metadata"]["annotations"] = dict(annotations or {})
        spec = request["object"]["spec"]
        spec.pop("schedulerName", None)
        if scheduler is not None:
            spec["schedulerName"] = scheduler
        if affinity is not None:
            spec["affinity"] = copy.deepcopy(affinity)
    return recorded(change)


def _stored(data: dict[str, Any], policy: review.Policy = POLICY) -> tuple[dict[str, Any], dict[str, Any]]:
    rev = review.read_review(data)
    answer = review.answer(rev, review.decide(rev.request, policy))
    patch = decoded_patch(answer) if "patch" in answer["response"] else []
    return apply_patch(pod_of(data), patch), answer["response"]


def _terms(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return pod["spec"]["affinity"]["nodeAffinity"][REQUIRED]["nodeSelectorTerms"]


def test_require_nvlink_becomes_the_fabric_in_nvswitch_or_nvlink_and_an_nvlink_ring_of_the_pods_size() -> None:
    pod, response = _stored(_review(4, {DEFAULT_KEYS.require_nvlink: "true"}))
    assert pod["spec"]["schedulerName"] == SCHEDULER
    assert _terms(pod) == [{"matchExpressions": [NVLINK, ring(4)]}]
    assert "warnings" not in response


def test_a_bandwidth_floor_becomes_gt_on_the_label_of_the_pods_size() -> None:
    for asked, gt in (("100", "99"), ("99.5", "99"), ("0.4", "0")):
        pod, _ = _stored(_review(3, {DEFAULT_KEYS.min_gbps: asked}))
        assert _terms(pod) == [{"matchExpressions": [
            {"key": "gpu-topology.io/allreduce-gbps-3", "operator": "Gt", "values": [gt]}]}], asked


def test_no_affinity_for_one_gpu_no_constraint_or_when_turned_off() -> None:
    for data, policy in ((_review(1, {DEFAULT_KEYS.require_nvlink: "true"}), POLICY),
                         (_review(4, {}), POLICY),
                         (_review(4, {DEFAULT_KEYS.require_nvlink: "false"}), POLICY),
                         (_review(4, {DEFAULT_KEYS.require_nvlink: "true"}),
                          review.Policy(SCHEDULER, "nvidia.com/gpu", "gpu-topology.io/webhook",
                                        topology_affinity=False))):
        pod, _ = _stored(data, policy)
        assert pod["spec"]["schedulerName"] == SCHEDULER
        assert "affinity" not in pod["spec"]


def test_a_pod_already_naming_the_scheduler_gets_the_affinity_too() -> None:
    pod, response = _stored(_review(8, {DEFAULT_KEYS.require_nvlink: "true"}, scheduler=SCHEDULER))
    assert _terms(pod) == [{"matchExpressions": [NVLINK, ring(8)]}]
    pod, response = _stored(_review(8, {}, scheduler=SCHEDULER))
    assert "patch" not in response


def test_an_unreadable_annotation_leaves_the_affinity_alone_with_one_warning() -> None:
    pod, response = _stored(_review(4, {DEFAULT_KEYS.min_gbps: "fast"}))
    assert pod["spec"]["schedulerName"] == SCHEDULER and "affinity" not in pod["spec"]
    assert response["warnings"] == [review.warning(
        "gpu-topology webhook added no node affinity: annotation gpu-topology.io/min-allreduce-gbps='fast' must be "
        "a number of GB/s")]


def test_existing_terms_each_get_the_expressions_once() -> None:
    affinity = {"podAntiAffinity": {}, "nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]},
        {"matchExpressions": [NVLINK]},
    ]}}}
    pod, _ = _stored(_review(4, {DEFAULT_KEYS.require_nvlink: "true"}, affinity))
    terms = _terms(pod)
    assert terms[0]["matchExpressions"] == [{"key": "zone", "operator": "In", "values": ["a"]}, NVLINK, ring(4)]
    assert terms[1] == {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}],
                        "matchExpressions": [NVLINK, ring(4)]}
    assert terms[2]["matchExpressions"] == [NVLINK, ring(4)]
    assert pod["spec"]["affinity"]["podAntiAffinity"] == {}


def _matches(expr: dict[str, Any], labels: dict[str, str]) -> bool:
    value = labels.get(expr["key"])
    op = expr["operator"]
    if op == "In":
        return value in expr["values"]
    if op == "NotIn":  # as kube-scheduler's selector: a node without the label matches
        return value not in expr["values"]
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    assert op == "Gt"
    return value is not None and value.isdigit() and int(value) > int(expr["values"][0])


def _node_matches(pod: dict[str, Any], labels: dict[str, str]) -> bool:
    terms = pod["spec"].get("affinity", {}).get("nodeAffinity", {}).get(REQUIRED, {}).get("nodeSelectorTerms")
    if terms is None:
        return True
    return any(all(_matches(e, labels) for e in t.get("matchExpressions", [])) for t in terms)


_LABEL_VALUES = st.sampled_from(["nvswitch", "nvlink", "pcie", None])
_EXPR = st.builds(lambda k, v: {"key": k, "operator": "In", "values": [v]}, st.sampled_from(["zone", "pool"]),
                  st.sampled_from(["a", "b"]))
_AFFINITY = st.one_of(
    st.none(),
    st.just({"podAffinity": {}}),
    st.just({"nodeAffinity": {}}),
    st.lists(st.lists(_EXPR, max_size=2), min_size=1, max_size=3).map(
        lambda terms: {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [{"matchExpressions": t} for t in terms]}}}),
)


@settings(max_examples=200, deadline=None)
@given(affinity=_AFFINITY, nvlink=st.booleans(), gbps=st.sampled_from([None, 50, 99.5, 240]),
       fabric=_LABEL_VALUES, zone=st.sampled_from(["a", "b", None]), pool=st.sampled_from(["a", "b", None]),
       best=st.integers(0, 500), size=st.integers(1, 8), ring=st.sampled_from([None, "true", "false"]))
def test_a_node_matches_the_patched_pod_exactly_when_it_matched_and_meets_the_constraints(
        affinity: Any, nvlink: bool, gbps: float | None, fabric: str | None, zone: str | None, pool: str | None,
        best: int, size: int, ring: str | None) -> None:
    ann = {DEFAULT_KEYS.require_nvlink: "true"} if nvlink else {}
    if gbps is not None:
        ann[DEFAULT_KEYS.min_gbps] = str(gbps)
    data = _review(size, ann, affinity)
    before = pod_of(data)
    after, _ = _stored(data)
    labels = {k: v for k, v in {"zone": zone, "pool": pool, DEFAULT_KEYS.fabric_label: fabric}.items() if v}
    labels[DEFAULT_KEYS.allreduce_label(size)] = str(best)
    if ring is not None:
        labels[DEFAULT_KEYS.nvlink_ring_label(size)] = ring
    meets = size < 2 or ((not nvlink or (fabric in NVLINK_FABRICS and ring != "false"))
                         and (gbps is None or best >= gbps))
    assert _node_matches(after, labels) == (_node_matches(before, labels) and meets)


def _replicas(request: dict[str, Any], name: str, n: int) -> None:
    res = request["object"]["spec"]["containers"][0]["resources"]
    for part in res.values():
        part.pop("nvidia.com/gpu", None)
        part[name] = str(n)


def test_k_replicas_of_a_shared_name_need_k_gpus_with_a_free_replica_where_the_label_says() -> None:
    """The label absent (a node whose plugin does not publish it) or enough GPUs with a free replica."""
    renamed = review.Policy(SCHEDULER, "nvidia.com/gpu", "gpu-topology.io/webhook", extra_resources=("acme.io/slice",),
                            replica_resources=("acme.io/slice",))
    for name, n, key in (("nvidia.com/gpu.shared", 3, "gpu-topology.io/free-gpus.gpu.shared"),
                         ("acme.io/slice", 2, "gpu-topology.io/free-gpus.slice"),
                         ("nvidia.com/gpu.shared", 1, None)):
        data = recorded(lambda r, name=name, n=n: _replicas(r, name, n))
        data["request"]["object"]["spec"].pop("schedulerName", None)
        pod, _ = _stored(data, renamed)
        assert pod["spec"]["schedulerName"] == SCHEDULER
        if key is None:
            assert "affinity" not in pod["spec"], name
        else:
            # one container asks them all: nodes refusing more than one per container are out too
            one = {"key": key.replace("/free-gpus.", "/one-replica-per-container."), "operator": "DoesNotExist"}
            assert _terms(pod) == [{"matchExpressions": [one, {"key": key, "operator": "DoesNotExist"}]},
                                   {"matchExpressions": [one, {"key": key, "operator": "Gt",
                                                               "values": [str(n - 1)]}]}]


def test_another_managed_name_is_not_taken_for_replicas() -> None:
    """--extra-resources may name whole GPUs of another resource: only --replica-resources names get the label."""
    policy = review.Policy(SCHEDULER, "nvidia.com/gpu", "gpu-topology.io/webhook", extra_resources=("acme.io/gpu",))
    data = recorded(lambda r: _replicas(r, "acme.io/gpu", 4))
    data["request"]["object"]["spec"].pop("schedulerName", None)
    pod, _ = _stored(data, policy)
    assert pod["spec"]["schedulerName"] == SCHEDULER and "affinity" not in pod["spec"]


UNRENAMED = review.Policy(SCHEDULER, "nvidia.com/gpu", "gpu-topology.io/webhook",
                          replica_resources=("nvidia.com/gpu",))
FREE = "gpu-topology.io/free-gpus.gpu"


def test_the_unrenamed_resource_gets_the_label_absent_or_enough_free_gpus() -> None:
    pod, _ = _stored(_review(3, {}), UNRENAMED)
    one = {"key": "gpu-topology.io/one-replica-per-container.gpu", "operator": "DoesNotExist"}
    assert _terms(pod) == [{"matchExpressions": [one, {"key": FREE, "operator": "DoesNotExist"}]},
                           {"matchExpressions": [one, {"key": FREE, "operator": "Gt", "values": ["2"]}]}]
    again = recorded(lambda r: (_gpus(r, 3), r["object"]["spec"].update(affinity=pod["spec"]["affinity"])))
    again["request"]["object"]["spec"].pop("schedulerName", None)
    assert _stored(again, UNRENAMED)[0]["spec"]["affinity"] == pod["spec"]["affinity"], "not split twice"
    one, _ = _stored(_review(1, {}), UNRENAMED)
    assert "affinity" not in one["spec"]


@settings(max_examples=200, deadline=None)
@given(affinity=_AFFINITY, nvlink=st.booleans(), fabric=_LABEL_VALUES, zone=st.sampled_from(["a", "b", None]),
       pool=st.sampled_from(["a", "b", None]), free=st.one_of(st.none(), st.integers(0, 8)), size=st.integers(1, 8),
       ring=st.sampled_from([None, "true", "false"]))
def test_with_the_alternative_a_node_matches_exactly_when_it_should(
        affinity: Any, nvlink: bool, fabric: str | None, zone: str | None, pool: str | None, free: int | None,
        size: int, ring: str | None) -> None:
    ann = {DEFAULT_KEYS.require_nvlink: "true"} if nvlink else {}
    data = _review(size, ann, affinity)
    before = pod_of(data)
    after, _ = _stored(data, UNRENAMED)
    labels = {k: v for k, v in {"zone": zone, "pool": pool, DEFAULT_KEYS.fabric_label: fabric}.items() if v}
    if free is not None:
        labels[FREE] = str(free)
    if ring is not None:
        labels[DEFAULT_KEYS.nvlink_ring_label(size)] = ring
    meets = size < 2 or ((not nvlink or (fabric in NVLINK_FABRICS and ring != "false"))
                         and (free is None or free >= size))
    assert _node_matches(after, labels) == (_node_matches(before, labels) and meets)


ONE = "gpu-topology.io/one-replica-per-container.gpu.shared"
SHARED_FREE = "gpu-topology.io/free-gpus.gpu.shared"


def _containers(request: dict[str, Any], apps: list[int], inits: list[int] = ()) -> None:  # type: ignore[assignment]
    """The pod's containers replaced by ones asking these counts of nvidia.com/gpu.shared."""
    spec = request["object"]["spec"]
    template = spec["containers"][0]
    spec.pop("schedulerName", None)

    def make(name: str, n: int) -> dict[str, Any]:
        c = copy.deepcopy(template)
        c["name"] = name
        c["resources"] = {"limits": {"nvidia.com/gpu.shared": str(n)}, "requests": {"nvidia.com/gpu.shared": str(n)}}
        return c
    spec["containers"] = [make(f"app{i}", n) for i, n in enumerate(apps)]
    if inits:
        spec["initContainers"] = [make(f"init{i}", n) for i, n in enumerate(inits)]


def test_a_container_asking_two_replicas_keeps_off_nodes_refusing_more_than_one_per_container() -> None:
    """failRequestsGreaterThanOne refuses per container (the kubelet's Allocate): the plugin's label on such nodes
    must be absent, in every term, next to the free-gpus alternative."""
    pod, _ = _stored(recorded(lambda r: _containers(r, [2])))
    absent = {"key": ONE, "operator": "DoesNotExist"}
    assert _terms(pod) == [
        {"matchExpressions": [absent, {"key": SHARED_FREE, "operator": "DoesNotExist"}]},
        {"matchExpressions": [absent, {"key": SHARED_FREE, "operator": "Gt", "values": ["1"]}]}]
    assert _node_matches(pod, {SHARED_FREE: "8"})
    assert not _node_matches(pod, {SHARED_FREE: "8", ONE: "true"})


def test_one_replica_per_container_is_judged_per_container_init_containers_too() -> None:
    """Two containers of one replica each are admitted under the flag (free-gpus only); an init container asking
    two is refused there like an app container."""
    split, _ = _stored(recorded(lambda r: _containers(r, [1, 1])))
    assert all(e["key"] != ONE for t in _terms(split) for e in t["matchExpressions"])
    assert _node_matches(split, {SHARED_FREE: "8", ONE: "true"})
    init, _ = _stored(recorded(lambda r: _containers(r, [1], inits=[2])))
    assert all({"key": ONE, "operator": "DoesNotExist"} in t["matchExpressions"] for t in _terms(init))
    single, _ = _stored(recorded(lambda r: _containers(r, [1])))
    assert "affinity" not in single["spec"]


def test_the_one_replica_requirement_is_added_once_and_not_when_turned_off() -> None:
    pod, _ = _stored(recorded(lambda r: _containers(r, [3])))

    def again(r: dict[str, Any]) -> None:
        _containers(r, [3])
        r["object"]["spec"]["affinity"] = copy.deepcopy(pod["spec"]["affinity"])
    assert _stored(recorded(again))[0]["spec"]["affinity"] == pod["spec"]["affinity"]
    off = review.Policy(SCHEDULER, "nvidia.com/gpu", "gpu-topology.io/webhook", topology_affinity=False)
    assert "affinity" not in _stored(recorded(lambda r: _containers(r, [3])), off)[0]["spec"]
