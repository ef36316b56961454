"""sim/autoscaler.py: CA's in-tree fit on Kubernetes-shaped dicts (the semantics kube-scheduler's plugins have, since
another test uses `fits` as a stand-in for CA)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from sim import autoscaler as ca

GPU = "nvidia.com/gpu"


def node(labels: dict[str, str] | None = None, taints: list[dict[str, str]] | None = None,
         alloc: dict[str, Any] | None = None, name: str = "n1", unschedulable: bool = False) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {}},
            "spec": {"taints": taints or [], **({"unschedulable": True} if unschedulable else {})},
            "status": {"allocatable": alloc if alloc is not None else {GPU: "8", "cpu": "32", "memory": "256Gi"}}}


def pod(gpus: int = 1, *, requests: dict[str, Any] | None = None, limits: dict[str, Any] | None = None,
        selector: dict[str, str] | None = None, terms: list[list[dict[str, Any]]] | None = None,
        tolerations: list[dict[str, str]] | None = None) -> dict[str, Any]:
    res: dict[str, Any] = {"limits": {GPU: gpus, **(limits or {})}}
    if requests:
        res["requests"] = requests
    spec: dict[str, Any] = {"containers": [{"name": "c", "resources": res}]}
    if selector:
        spec["nodeSelector"] = selector
    if terms is not None:
        spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": t} for t in terms]}}}
    if tolerations:
        spec["tolerations"] = tolerations
    return {"metadata": {"name": "p", "ownerReferences": [{"kind": "Job", "name": "j"}]}, "spec": spec}


def expr(key: str, op: str, *values: str) -> dict[str, Any]:
    return {"key": key, "operator": op, "values": list(values)} if values else {"key": key, "operator": op}


# -- resources -----------------------------------------------------------------------------------------------------


def test_gpu_count_against_allocatable_minus_used() -> None:
    assert ca.fits(pod(4), node(), {GPU: 4}) is None
    assert ca.fits(pod(5), node(), {GPU: 4}) == f"Insufficient {GPU}"
    assert ca.fits(pod(1), node(alloc={"cpu": "8"}), {}) == f"Insufficient {GPU}"  # not advertised: none


def test_limits_only_count_as_requests_and_requests_win_over_limits() -> None:
    p = pod(0, limits={"example.com/fpga": "2"})
    assert ca.fits(p, node(alloc={"example.com/fpga": 2}), {"example.com/fpga": 1}) == "Insufficient example.com/fpga"
    p = pod(0, requests={"cpu": "500m"}, limits={"cpu": "64"})
    assert ca.pod_requests(p)["cpu"] == 500
    assert ca.fits(p, node(), {"cpu": 31_500}) is None
    assert ca.fits(p, node(), {"cpu": 31_501}) == "Insufficient cpu"


def test_quantities_and_several_shortfalls() -> None:
    p = pod(2, requests={"memory": "1Gi", "cpu": "1.5"})
    assert ca.pod_requests(p) == {GPU: 2, "memory": 2**30, "cpu": 1500}
    reason = ca.fits(p, node(alloc={GPU: 1, "memory": "1Mi", "cpu": 64}), {})
    assert reason == f"Insufficient memory, Insufficient {GPU}"


def test_init_containers_and_sidecars_follow_pod_requests() -> None:
    p = {"spec": {"initContainers": [
        {"name": "side", "restartPolicy": "Always", "resources": {"limits": {GPU: 1}}},
        {"name": "init", "resources": {"limits": {GPU: 4}}}],
        "containers": [{"name": "c", "resources": {"limits": {GPU: 2}}}]}}
    assert ca.pod_requests(p)[GPU] == 5  # init 4 + sidecar 1 > app 2 + sidecar 1


def test_pod_count_checked_when_advertised() -> None:
    assert ca.fits(pod(1), node(alloc={GPU: 8, "pods": 2}), {"pods": 2}) == ca.TOO_MANY_PODS
    assert ca.fits(pod(1), node(alloc={GPU: 8, "pods": 2}), {"pods": 1}) is None


# -- node affinity -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("op", "values", "labels", "ok"), [
    ("In", ["a", "b"], {"k": "b"}, True),
    ("In", ["a"], {"k": "c"}, False),
    ("In", ["a"], {}, False),
    ("NotIn", ["a"], {"k": "c"}, True),
    ("NotIn", ["a"], {}, True),
    ("NotIn", ["a"], {"k": "a"}, False),
    ("Exists", [], {"k": ""}, True),
    ("Exists", [], {}, False),
    ("DoesNotExist", [], {}, True),
    ("DoesNotExist", [], {"k": "x"}, False),
    ("Gt", ["99"], {"k": "100"}, True),
    ("Gt", ["100"], {"k": "100"}, False),
    ("Lt", ["100"], {"k": "99"}, True),
    ("Lt", ["99"], {"k": "99"}, False),
    ("Gt", ["1"], {}, False),  # missing label
    ("Gt", ["1"], {"k": "1.5"}, False),  # non-integer label
    ("Gt", ["1.0"], {"k": "5"}, False),  # non-integer bound
    ("Gt", ["1", "2"], {"k": "5"}, False),  # Gt takes one value
    ("In", [], {"k": "a"}, False),  # In needs values
    ("Exists", ["a"], {"k": "a"}, False),  # Exists takes none
    ("Bogus", ["a"], {"k": "a"}, False),
])
def test_each_operator(op: str, values: list[str], labels: dict[str, str], ok: bool) -> None:
    got = ca.fits(pod(1, terms=[[expr("k", op, *values)]]), node(labels), {})
    assert (got is None) is ok
    if not ok:
        assert got == ca.AFFINITY_MISMATCH


def test_terms_are_ored_and_expressions_anded() -> None:
    labels = {"a": "1", "b": "2"}
    both = [expr("a", "In", "1"), expr("b", "In", "2")]
    one_wrong = [expr("a", "In", "1"), expr("b", "In", "3")]
    assert ca.fits(pod(1, terms=[both]), node(labels), {}) is None
    assert ca.fits(pod(1, terms=[one_wrong]), node(labels), {}) is not None
    assert ca.fits(pod(1, terms=[one_wrong, both]), node(labels), {}) is None
    assert ca.fits(pod(1, terms=[[]]), node(labels), {}) is not None  # an empty term matches nothing
    assert ca.fits(pod(1, terms=[]), node(labels), {}) is not None  # no term: nothing


def test_node_selector_and_affinity_both_apply() -> None:
    p = pod(1, selector={"pool": "gpu"}, terms=[[expr("fabric", "In", "nvswitch")]])
    assert ca.fits(p, node({"pool": "gpu", "fabric": "nvswitch"}), {}) is None
    assert ca.fits(p, node({"pool": "cpu", "fabric": "nvswitch"}), {}) == ca.AFFINITY_MISMATCH
    assert ca.fits(p, node({"fabric": "nvswitch"}), {}) == ca.AFFINITY_MISMATCH
    assert ca.fits(p, node({"pool": "gpu", "fabric": "pcie"}), {}) == ca.AFFINITY_MISMATCH


def test_match_fields_metadata_name() -> None:
    p = pod(1)
    p["spec"]["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchFields": [expr("metadata.name", "In", "n1")]}]}}}
    assert ca.fits(p, node(name="n1"), {}) is None
    assert ca.fits(p, node(name="n2"), {}) == ca.AFFINITY_MISMATCH


_GO_INT64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)


@given(_GO_INT64, _GO_INT64)
def test_gt_lt_compare_as_integers(label: int, bound: int) -> None:
    labels = {"k": str(label)}
    gt = ca.fits(pod(1, terms=[[expr("k", "Gt", str(bound))]]), node(labels), {}) is None
    lt = ca.fits(pod(1, terms=[[expr("k", "Lt", str(bound))]]), node(labels), {}) is None
    assert gt == (label > bound) and lt == (label < bound)


@given(st.text(max_size=6))
@example("0\n")  # Python's int() takes it, Go's ParseInt does not
def test_gt_on_text_matches_only_go_integers(text: str) -> None:
    ok = ca.expression_matches(expr("k", "Gt", "-1000000"), {"k": text})
    stripped = text[1:] if text[:1] in "+-" else text
    is_go_int = bool(stripped) and all(c in "0123456789" for c in stripped)
    assert ok == (is_go_int and int(text) > -1_000_000)


def test_gt_out_of_int64_range_fails() -> None:
    assert not ca.expression_matches(expr("k", "Gt", "0"), {"k": str(2**63)})


# -- taints --------------------------------------------------------------------------------------------------------

TAINT = {"key": "gpu", "value": "shared", "effect": "NoSchedule"}


@pytest.mark.parametrize(("effect", "blocks"), [("NoSchedule", True), ("NoExecute", True),
                                                ("PreferNoSchedule", False)])
def test_taint_effects(effect: str, blocks: bool) -> None:
    got = ca.fits(pod(1), node(taints=[{**TAINT, "effect": effect}]), {})
    assert (got == "node(s) had untolerated taint {gpu: shared}") is blocks
    assert (got is None) is not blocks


@pytest.mark.parametrize(("toleration", "ok"), [
    ({"key": "gpu", "operator": "Equal", "value": "shared", "effect": "NoSchedule"}, True),
    ({"key": "gpu", "value": "shared"}, True),  # default operator Equal, empty effect: any effect
    ({"key": "gpu", "operator": "Equal", "value": "other"}, False),
    ({"key": "gpu", "operator": "Exists"}, True),
    ({"key": "gpu", "operator": "Exists", "effect": "NoExecute"}, False),
    ({"operator": "Exists"}, True),  # empty key + Exists tolerates everything
    ({"key": "other", "operator": "Exists"}, False),
])
def test_tolerations(toleration: dict[str, str], ok: bool) -> None:
    assert (ca.fits(pod(1, tolerations=[toleration]), node(taints=[TAINT]), {}) is None) is ok


def test_every_taint_needs_a_toleration_and_cordon() -> None:
    second = {"key": ca.TO_BE_DELETED_TAINT, "value": "", "effect": "NoSchedule"}
    p = pod(1, tolerations=[{"key": "gpu", "operator": "Exists"}])
    want = f"node(s) had untolerated taint {{{ca.TO_BE_DELETED_TAINT}: }}"
    assert ca.fits(p, node(taints=[TAINT, second]), {}) == want
    assert ca.fits(pod(1), node(unschedulable=True), {}) == ca.UNSCHEDULABLE_NODE


# -- scale-up / scale-down rules -----------------------------------------------------------------------------------
