"""The webhook's rule, through extender.webhook.review (pure): the recorded kube-apiserver review gets exactly the
recorded JSONPatch, and every pod it does not manage, or cannot read, is allowed unchanged."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extender.webhook import review
from gputopo.podspec import PodSpecError, pod_device_count
from tests.extender.webhook.recordings import PATCH, RESPONSE, SCHEDULER, STORED, apply_patch, decoded_patch, pod_of
from tests.extender.webhook.recordings import review as recorded

POLICY = review.Policy(SCHEDULER, "nvidia.com/gpu", "gpu-topology.io/webhook")


def answer_for(data: dict[str, Any]) -> dict[str, Any]:
    rev = review.read_review(data)
    return review.answer(rev, review.decide(rev.request, POLICY))


def test_the_recorded_review_gets_the_recorded_patch_and_the_stored_pod_follows() -> None:
    data = recorded()
    answer = answer_for(data)
    assert answer["apiVersion"] == RESPONSE["apiVersion"] and answer["kind"] == RESPONSE["kind"]
    assert {k: v for k, v in answer["response"].items() if k != "patch"} == {
        k: v for k, v in RESPONSE["response"].items() if k != "patch"}
    assert decoded_patch(answer) == PATCH
    patched = apply_patch(pod_of(data), decoded_patch(answer))
    assert patched["spec"]["schedulerName"] == STORED["spec"]["schedulerName"] == SCHEDULER
    assert {k: v for k, v in patched["spec"].items() if k != "schedulerName"}.keys() <= STORED["spec"].keys()


def _containers(request: dict[str, Any]) -> list[dict[str, Any]]:
    return request["object"]["spec"]["containers"]


def _gpu_in_init_only(request: dict[str, Any], restart: str | None = None) -> None:
    app = _containers(request)[0]
    init = {"name": "fetch", "image": "busybox", "resources": app.pop("resources")}
    if restart:
        init["restartPolicy"] = restart
    request["object"]["spec"]["initContainers"] = [init]


CASES: dict[str, tuple[Any, str]] = {
    "recorded": (None, review.PATCHED),
    "requests only": (lambda r: _containers(r)[0]["resources"].pop("limits"), review.PATCHED),
    "GPU in an init container only": (_gpu_in_init_only, review.PATCHED),
    "GPU in a sidecar only": (lambda r: _gpu_in_init_only(r, "Always"), review.PATCHED),
    "no scheduler name": (lambda r: r["object"]["spec"].pop("schedulerName"), review.PATCHED),
    "empty scheduler name": (lambda r: r["object"]["spec"].update(schedulerName=""), review.PATCHED),
    "null scheduler name": (lambda r: r["object"]["spec"].update(schedulerName=None), review.PATCHED),
    "dry run": (lambda r: r.update(dryRun=True), review.PATCHED),
    "another scheduler": (lambda r: r["object"]["spec"].update(schedulerName="volcano"), review.OTHER_SCHEDULER),
    "a scheduler name that is not a string": (lambda r: r["object"]["spec"].update(schedulerName=["x"]),
                                              review.OTHER_SCHEDULER),
    "already ours": (lambda r: r["object"]["spec"].update(schedulerName=SCHEDULER), review.ALREADY_OURS),
    "zero GPUs": (lambda r: _containers(r)[0]["resources"].update(limits={"nvidia.com/gpu": "0"},
                                                                   requests={"nvidia.com/gpu": "0"}),
                  review.NO_GPUS),
    "another resource": (lambda r: _containers(r)[0].update(resources={"limits": {"amd.com/gpu": "2"}}),
                         review.NO_GPUS),
    "no resources": (lambda r: _containers(r)[0].pop("resources"), review.NO_GPUS),
    "opted out": (lambda r: r["object"]["metadata"]["labels"].update({"gpu-topology.io/webhook": "disabled"}),
                  review.OPTED_OUT),
    "bound already": (lambda r: r["object"]["spec"].update(nodeName="n1"), review.ALREADY_BOUND),
    "update": (lambda r: r.update(operation="UPDATE"), review.NOT_MANAGED),
    "delete": (lambda r: r.update(operation="DELETE", object=None), review.NOT_MANAGED),
    "a subresource": (lambda r: r.update(subResource="binding"), review.NOT_MANAGED),
    "another kind": (lambda r: r.update(kind={"group": "apps", "version": "v1", "kind": "Deployment"}),
                     review.NOT_MANAGED),
    "no object": (lambda r: r.pop("object"), review.UNREADABLE_POD),
    "spec is a list": (lambda r: r["object"].update(spec=[]), review.UNREADABLE_POD),
    "containers not a list": (lambda r: r["object"]["spec"].update(containers={"c": {}}), review.UNREADABLE_POD),
    "a bad quantity": (lambda r: _containers(r)[0]["resources"]["limits"].update({"nvidia.com/gpu": "two"}),
                       review.UNREADABLE_POD),
    "a fractional GPU": (lambda r: _containers(r)[0]["resources"]["limits"].update({"nvidia.com/gpu": "1.5"}),
                         review.UNREADABLE_POD),
    "a MIG resource (mixed strategy)": (lambda r: _containers(r)[0].update(
        resources={"limits": {"nvidia.com/mig-1g.10gb": "1"}}), review.PATCHED),
    "a MIG resource in requests only, +me profile": (lambda r: _containers(r)[0].update(
        resources={"requests": {"nvidia.com/mig-1g.18gb.me": "2"}}), review.PATCHED),
    "a MIG resource in an init container only": (lambda r: (_containers(r)[0].update(
        resources={"limits": {"nvidia.com/mig-3g.40gb": "1"}}), _gpu_in_init_only(r)), review.PATCHED),
    "a MIG resource of another domain": (lambda r: _containers(r)[0].update(
        resources={"limits": {"example.com/mig-1g.10gb": "1"}}), review.NO_GPUS),
    "the bare MIG prefix": (lambda r: _containers(r)[0].update(resources={"limits": {"nvidia.com/mig-": "1"}}),
                            review.NO_GPUS),
    "zero MIG devices": (lambda r: _containers(r)[0].update(resources={"limits": {"nvidia.com/mig-1g.10gb": "0"}}),
                         review.NO_GPUS),
    "a bad MIG quantity": (lambda r: _containers(r)[0].update(
        resources={"limits": {"nvidia.com/mig-1g.10gb": "half"}}), review.UNREADABLE_POD),
    "labels not a map": (lambda r: r["object"]["metadata"].update(labels=["a"]), review.PATCHED),
    "metadata missing": (lambda r: r["object"].pop("metadata"), review.PATCHED),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_what_is_patched_and_what_is_left_alone(case: str) -> None:
    mutate, outcome = CASES[case]
    data = recorded(mutate)
    rev = review.read_review(data)
    decision = review.decide(rev.request, POLICY)
    assert decision.outcome == outcome
    answer = review.answer(rev, decision)["response"]
    assert answer["allowed"] is True and answer["uid"] == rev.uid
    if outcome == review.PATCHED:
        assert decoded_patch({"response": answer}) == PATCH
    else:
        assert "patch" not in answer and "patchType" not in answer
    if outcome == review.UNREADABLE_POD:
        (text,) = answer["warnings"]
        assert text.startswith("gpu-topology webhook left the pod to its scheduler: ")
        assert len(text) <= review.MAX_WARNING and text.isprintable()
    else:
        assert "warnings" not in answer


def test_a_warning_quoting_hostile_text_stays_one_short_printable_line() -> None:
    name = "c\n\x1b[31m" + "x" * 500
    data = recorded(lambda r: _containers(r)[0].update(
        name=name, resources={"limits": {"nvidia.com/gpu": "\u202e" * 300}}))
    (text,) = answer_for(data)["response"]["warnings"]
    assert len(text) <= review.MAX_WARNING and text.isprintable() and "\n" not in text


def test_an_internal_failure_is_answered_allowed_with_a_warning() -> None:
    rev = review.read_review(recorded())
    answer = review.answer(rev, review.failed(RuntimeError("boom")))["response"]
    assert answer == {"uid": rev.uid, "allowed": True,
                      "warnings": ["gpu-topology webhook left the pod to its scheduler: internal error (RuntimeError)"]}


NOT_REVIEWS: dict[str, Any] = {
    "a list": [],
    "another kind": {"kind": "Pod", "apiVersion": "v1"},
    "v1beta1": {**recorded(), "apiVersion": "admission.k8s.io/v1beta1"},
    "no request": {"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1"},
    "request not an object": {"kind": "AdmissionReview", "apiVersion": "admission.k8s.io/v1", "request": "x"},
    "no uid": recorded(lambda r: r.pop("uid")),
    "empty uid": recorded(lambda r: r.update(uid="")),
    "uid not a string": recorded(lambda r: r.update(uid=7)),
    "a huge uid": recorded(lambda r: r.update(uid="u" * 10_000)),
}


@pytest.mark.parametrize("case", sorted(NOT_REVIEWS))
def test_a_body_with_nothing_to_answer_to_is_refused(case: str) -> None:
    with pytest.raises(review.ReviewError) as caught:
        review.read_review(NOT_REVIEWS[case])
    assert len(str(caught.value)) < 300


# Anything a client could put where the pod's fields are read.
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5) | st.sampled_from(
    ["2", "0", "1e3", "default-scheduler", "", SCHEDULER, "nvidia.com/gpu"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(
        ["nvidia.com/gpu", "limits", "requests", "name", "restartPolicy", "resources", "x"]), inner, max_size=3),
    max_leaves=12)
_FIELDS = [("spec", "schedulerName"), ("spec", "nodeName"), ("spec", "initContainers"), ("spec", "containers"),
           ("metadata", "labels"), ("spec", "containers", 0, "resources"),
           ("spec", "containers", 0, "resources", "limits"), ("spec", "containers", 0, "name")]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_FIELDS), _json), max_size=4))
def test_any_pod_is_answered_and_only_a_default_scheduled_gpu_pod_is_patched(changes: list[Any]) -> None:
    pod = copy.deepcopy(pod_of(recorded()))
    for path, value in changes:
        target: Any = pod
        for part in path[:-1]:
            target = target[part] if (isinstance(target, dict) and part in target) or (
                isinstance(target, list) and isinstance(part, int) and part < len(target)) else None
            if target is None:
                break
        if isinstance(target, dict) or (
                isinstance(target, list) and isinstance(path[-1], int) and path[-1] < len(target)):
            target[path[-1]] = value
    decision = review.decide(recorded(lambda r: r.update(object=pod))["request"], POLICY)
    spec = pod.get("spec") if isinstance(pod.get("spec"), dict) else {}
    scheduler = spec.get("schedulerName")
    if decision.outcome != review.PATCHED:
        assert decision.patch == ()
        return
    assert scheduler is None or scheduler in ("", "default-scheduler")
    assert not spec.get("nodeName")
    try:
        def parts(c: Any) -> list[Any]:
            res = c.get("resources") if isinstance(c, dict) else None
            return [res.get(p) for p in ("limits", "requests")] if isinstance(res, dict) else []

        containers = [c for f in ("containers", "initContainers") if isinstance(spec.get(f), list) for c in spec[f]]
        asked = {k for c in containers for part in parts(c) if isinstance(part, dict) for k in part
                 if k.startswith("nvidia.com/mig-")}
        assert pod_device_count(pod, "nvidia.com/gpu") + sum(pod_device_count(pod, k) for k in asked) \
            == decision.gpus > 0
    except PodSpecError:  # pragma: no cover - a patched pod was readable
        pytest.fail("patched a pod whose GPU count cannot be read")


def test_a_mig_pod_is_counted_with_its_whole_gpus_and_gets_the_scheduler() -> None:
    """A pod asking whole GPUs in one container and a MIG device in another (issue 23): both are the node's GPUs,
    so the extender must place it; the decision counts both."""
    def both(r: dict[str, Any]) -> None:
        app = _containers(r)[0]
        side = {"name": "infer", "image": "x", "resources": {"limits": {"nvidia.com/mig-2g.20gb": "1"}}}
        app["resources"] = {"limits": {"nvidia.com/gpu": "2"}}
        _containers(r).append(side)

    decision = review.decide(review.read_review(recorded(both)).request, POLICY)
    assert decision.outcome == review.PATCHED and decision.gpus == 3 and decision.patch == tuple(PATCH)


def test_whole_jobs_sends_a_kubeflow_jobs_cpu_only_pods_too() -> None:
    """--whole-jobs: a TFJob's parameter server (no GPUs, the training operator's job label) gets the scheduler, so
    the extender can place it by its workers; without the switch, and for a pod of no job, it is left alone."""
    def ps(r: dict[str, Any]) -> None:
        _containers(r)[0].update(resources={"requests": {"cpu": "2", "memory": "4Gi"}})
        r["object"]["metadata"].setdefault("labels", {})["training.kubeflow.org/job-name"] = "tf-dist-mnist-ps"

    whole = review.Policy(SCHEDULER, "nvidia.com/gpu", "gpu-topology.io/webhook", whole_jobs=True)
    request = review.read_review(recorded(ps)).request
    assert review.decide(request, POLICY).outcome == review.NO_GPUS
    decision = review.decide(request, whole)
    assert decision.outcome == review.PATCHED and decision.gpus == 0 and decision.patch == tuple(PATCH)
    no_job = review.read_review(recorded(lambda r: _containers(r)[0].pop("resources"))).request
    assert review.decide(no_job, whole).outcome == review.NO_GPUS


def test_with_dra_claims_a_pod_with_a_claim_and_no_gpu_resource_gets_the_scheduler() -> None:
    """DRA mode: the GPUs come through a claim template, so no extended resource names them."""
    def claim_only(request: dict[str, Any]) -> None:
        spec = request["object"]["spec"]
        spec.pop("schedulerName", None)
        spec["containers"][0].pop("resources")
        spec["containers"][0]["resources"] = {"claims": [{"name": "gpus"}]}
        spec["resourceClaims"] = [{"name": "gpus", "resourceClaimTemplateName": "best-4-gpus"}]

    data = recorded(claim_only)
    rev = review.read_review(data)
    assert review.decide(rev.request, POLICY).outcome == review.NO_GPUS
    dra = review.Policy(SCHEDULER, "nvidia.com/gpu", "gpu-topology.io/webhook", dra_claims=True)
    decision = review.decide(rev.request, dra)
    assert decision.outcome == review.PATCHED
    assert decision.patch == ({"op": "add", "path": "/spec/schedulerName", "value": SCHEDULER},)
    empty = recorded(lambda r: (claim_only(r), r["object"]["spec"].update(resourceClaims=[])))
    assert review.decide(review.read_review(empty).request, dra).outcome == review.NO_GPUS
