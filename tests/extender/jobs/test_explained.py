"""What a job pod's placement explanation (`<prefix>/placement`) and its job's filter reasons say, through the verbs
over HTTP with the Binding posted to the in-process kube-apiserver (the owner kinds served).

A platform team saw, for one job of unknown size that ended on 2 nodes at 12.5 GB/s, its pods say "job est. 80.0",
"25.8", "25.8" and "12.5 GB/s", each worded as the job's figure; "PyTorchJob ml/x is not readable: not seen yet" of
pods with no ownerReference at all; "limited by the no collective"; and a reason cut at its end ("... 1 other jobs of
unknown size still growing, so it..."). Each pod now states the job as known at its bind, labelled so (extender.jobs.
plans.JobPlans.describe says why it is not patched later), and every reason is whole.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extender.config import ExtenderConfig
from extender.jobs.planner import JobRequest, JobUnplaceable, Member, plan_job
from extender.jobs.reasons import job_explained
from extender.placement.explain import MAX_CHARS, fitted
from extender.placement.reasons import Worded
from extender.service import Extender
from extender.state.pods import Need
from gputopo.contract import parse_plan
from gputopo.core.jobs import PodSlot, job_allreduce_gbps
from gputopo.kube import make_api_client
from sim.scheduler import SchedulerDriver, gpu_pod
from tests.extender.conftest import running
from tests.extender.jobs.conftest import DGX_A100, PREFIX, RACK, WAIT, cluster, k8s_node, kubeflow_pod, rated
from tests.extender.jobs.test_planner import LOC, hgx, node
from tests.fakes.kubeapi.jobs import FakeJobsKubeApi
from tests.helpers.scheduler import bind_body, cache_args

TOPO = rated(DGX_A100, 100.0)
PLACEMENT = f"{PREFIX}/placement"
NO_OWNER = "no ownerReference; label training.kubeflow.org/job-name: no PyTorchJob ml/train seen"
BAD = ("None", "the no ", "  ", "no collective", "est. 0.0")


def _whole(text: str, limit: int) -> None:
    """One line within its limit, no placeholder leaking, not cut at its end."""
    assert len(text) <= limit and "\n" not in text, text
    assert not any(b in text for b in BAD), text
    assert not text.endswith("...") and not text.endswith(" "), text


def _annotation(fake: FakeJobsKubeApi, pod: dict[str, Any]) -> str:
    stored = fake.pod(pod["metadata"]["namespace"], pod["metadata"]["name"])
    assert stored is not None
    return stored["metadata"]["annotations"][PLACEMENT]


def _figure_of(fake: FakeJobsKubeApi, ext: Extender, pods: list[dict[str, Any]]) -> str:
    """The estimate of these bound pods as one job, computed here from their plan annotations."""
    slots = []
    for pod in pods:
        stored = fake.pod(pod["metadata"]["namespace"], pod["metadata"]["name"])
        assert stored is not None
        plan = parse_plan(stored["metadata"]["annotations"][f"{PREFIX}/plan"])
        entry = ext.cache.nodes[plan.node]
        assert entry.topo is not None
        slots.append(PodSlot(plan.node, entry.topo, tuple(sorted(entry.topo.indices_of(plan.ids))), entry.place))
    est = job_allreduce_gbps(slots, ext.cache.locality)
    return "one GPU in all, no all-reduce" if est.gbps == 0 else f"est. {est.gbps:.1f} GB/s all-reduce"


def test_each_pod_of_a_job_of_unknown_size_says_the_job_so_far_with_it() -> None:
    """The team's job: pods labelled by the training operator but with no ownerReference (so no owner to read, and
    no size), 1 GPU each, bound one after another over two nodes of a rack. Each pod's explanation is labelled as
    the job so far, its figure that of the pods bound up to it (computed here from their plans), the last one the
    job's; none says "not readable: not seen yet" of an owner the pod does not have, nor "the no collective"."""
    with FakeJobsKubeApi() as fake:
        fake.add_node(k8s_node("n0", TOPO, rack="r0", used=list(range(5))))
        fake.add_node(k8s_node("n1", TOPO, rack="r0"))
        pods = [fake.add_pod(kubeflow_pod("train", i, 1, pod_group=False)) for i in range(5)]
        api = make_api_client(host=fake.url, timeout_s=5.0)
        try:
            with cluster(api) as (ext, client):
                driver = SchedulerDriver(str(client.base_url))
                try:
                    texts, figures = [], []
                    for i, pod in enumerate(pods):
                        assert driver.schedule(pod, ["n0", "n1"]).node is not None
                        texts.append(_annotation(fake, pod))
                        figures.append(_figure_of(fake, ext, pods[:i + 1]))
                finally:
                    driver.close()
        finally:
            api.close()
    for i, (text, fig) in enumerate(zip(texts, figures, strict=True)):
        _whole(text, MAX_CHARS)
        assert f"(size unknown, {NO_OWNER}; placed a pod at a time)" in text, text
        assert "not readable" not in text and "not seen yet" not in text, text
        assert f"job so far, with this pod: {i + 1} of ? workers on " in text, text
        assert f"), {fig}" in text and text.endswith("; later pods may change it"), (fig, text)
    assert "on node n0 (n0 x1), one GPU in all, no all-reduce; later" in texts[0]
    assert "on node n0 (n0 x3), est. 25.8 GB/s all-reduce, limited by the host path" in texts[2]
    assert ("on rack r0 (n0 x3, n1 x2), est. 12.5 GB/s all-reduce, limited by the network inside one rack"
            in texts[4]), texts[4]


def test_a_pod_with_an_owner_reference_says_its_owner_is_not_seen_yet() -> None:
    """The other side of it: a pod whose ownerReference names a PyTorchJob the extender has not seen does have an
    owner, and is told so."""
    with FakeJobsKubeApi() as fake:
        fake.add_node(k8s_node("n0", TOPO, rack="r0"))
        pod = kubeflow_pod("train", 0, 2, pod_group=False)
        pod["metadata"]["ownerReferences"] = [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
                                               "name": "train", "uid": "0b1c", "controller": True}]
        pod = fake.add_pod(pod)
        api = make_api_client(host=fake.url, timeout_s=5.0)
        try:
            with cluster(api) as (_, client):
                driver = SchedulerDriver(str(client.base_url))
                try:
                    assert driver.schedule(pod, ["n0"]).node == "n0"
                finally:
                    driver.close()
        finally:
            api.close()
        text = _annotation(fake, pod)
    _whole(text, MAX_CHARS)
    assert "(size unknown, PyTorchJob ml/train is not readable: not seen yet; placed a pod at a time)" in text, text
    assert "job so far, with this pod: 1 of ? workers on node n0 (n0 x1), est. " in text, text


def test_a_first_pod_that_waits_says_why_in_one_whole_sentence() -> None:
    """Two jobs of unknown size, one node: the second job's first pod waits while the first still grows there. Its
    reason, the same on every node, was cut at 200 characters mid-sentence and said "1 other jobs"."""
    with FakeJobsKubeApi() as fake:
        fake.add_node(k8s_node("n0", TOPO, rack="r0"))
        first = fake.add_pod(kubeflow_pod("train", 0, 4, pod_group=False))
        second = fake.add_pod(kubeflow_pod("other", 0, 4, pod_group=False))
        api = make_api_client(host=fake.url, timeout_s=5.0)
        try:
            with cluster(api) as (ext, client):
                assert ext.cache.wait_for(lambda: len(ext.cache.pods) == 2, WAIT)
                driver = SchedulerDriver(str(client.base_url))
                try:
                    assert driver.schedule(first, ["n0"]).node == "n0"
                finally:
                    driver.close()
                out = client.post("/filter", json=cache_args(second, ["n0"])).json()
        finally:
            api.close()
    assert out["NodeNames"] == []
    reason = out["FailedNodes"]["n0"]
    _whole(reason, 300)
    assert reason == ("job ml/pytorchjob-controller/other: size unknown (no ownerReference; label "
                      "training.kubeflow.org/job-name: no PyTorchJob ml/other seen); its first pod waits: the nodes "
                      "with room for 4 GPUs hold 1 other job of unknown size still growing (set "
                      "gpu-topology.io/job-size to plan it whole)"), reason


def test_each_pod_of_a_job_of_known_size_says_its_plan_at_its_bind() -> None:
    with FakeJobsKubeApi() as fake:
        for name in ("n0", "n1"):
            fake.add_node(k8s_node(name, TOPO, rack="r0", used=list(range(6))))
        pods = [fake.add_pod(kubeflow_pod("train", i, 2, pod_group=False,
                                          annotations={f"{PREFIX}/job-size": "2"})) for i in range(2)]
        api = make_api_client(host=fake.url, timeout_s=5.0)
        try:
            with cluster(api) as (ext, client):
                driver = SchedulerDriver(str(client.base_url))
                try:
                    for pod in pods:
                        assert driver.schedule(pod, ["n0", "n1"]).node is not None
                finally:
                    driver.close()
                fig = _figure_of(fake, ext, pods)
        finally:
            api.close()
        texts = [_annotation(fake, p) for p in pods]
    for i, text in enumerate(texts):
        _whole(text, MAX_CHARS)
        assert (f"(2 workers, from annotation {PREFIX}/job-size): {i + 1} of 2 placed with this pod; planned at this "
                f"bind: the job on rack r0 (n0 x1, n1 x1), {fig}, limited by the network inside one rack") in text, text
        assert "so far" not in text


def test_a_plan_of_one_gpu_names_no_limit_and_counts_agree() -> None:
    """The planner's own words (its log summary, a node's reason, its refusals): one GPU in all is no all-reduce,
    not "est. 0.0 GB/s ... limited by the no collective"; one pod is "1 more worker"."""
    one = plan_job(JobRequest("ml/j", 1, None), [node("a", hgx(100.0), "r1")], LOC)
    slot = one.slots[0].node
    assert one.summary.endswith("the job on node a (a x1), one GPU in all, no all-reduce"), one.summary
    assert one.reason_for(slot).endswith("it keeps the job on node a (one GPU in all, no all-reduce)")
    assert one.limit_text == "no all-reduce"
    with pytest.raises(JobUnplaceable) as e:
        plan_job(JobRequest("ml/j", 8, 2, (Member("a", tuple(range(8))),)), [node("a", hgx(100.0), "r1", 0)], LOC)
    assert e.value.reason == "job ml/j: needs 1 more worker of 8 GPUs, the cluster has room for 0 now (1 placed)"


def test_a_long_explanation_gives_way_in_its_names_and_notes_never_in_its_figure() -> None:
    head = "n" * 63 + " GPUs 0-3: 240.0 GB/s, efficiency vs the empty node 1.00"
    job = job_explained("ml/" + "j" * 240, "size unknown, " + "why " * 60 + "; placed a pod at a time",
                        "job so far, with this pod: 3 of ? workers on {where} ({nodes}), est. 12.5 GB/s all-reduce, "
                        "limited by the network inside one rack; later pods may change it",
                        where="rack " + "r" * 60, nodes="a x1, b x2")
    rest = ["fastest offered 240.0 GB/s on " + "m" * 63 + ", ranked below a tighter fit that keeps larger free sets "
            "whole", "constraints: require-nvlink, min-allreduce 100 GB/s"]
    text = fitted(head, job, rest)
    _whole(text, MAX_CHARS)
    assert text.startswith(head + "; job ml/") and text.endswith(" require-nvlink, min-allreduce 100 GB/s"), text
    assert "job so far, with this pod: 3 of ? workers on " in text, text
    assert "est. 12.5 GB/s all-reduce, limited by the network inside one rack; later pods may change it; " in text
    assert fitted(head, "job ml/j (1 worker)", rest) == "; ".join([head, "job ml/j (1 worker)", *rest])  # fits


# -- every reason of random job shapes, through the verbs -------------------------------------------------------------

NODES = ["a0", "a1", "b0", "b1"]
LONG = "x" * 200 + "-job"  # a valid job name near the limit: names are elided, never the sentence's end
shape_st = st.tuples(st.integers(1, 6), st.sampled_from([1, 2, 4, 8]), st.booleans(),
                     st.sampled_from(["train", LONG, "a.b_c"]))
used_st = st.lists(st.integers(0, 8), min_size=len(NODES), max_size=len(NODES))
ENDED_WORD = re.compile(r"[\w)]$")


def _check_reason(text: str) -> None:
    _whole(text, 300)
    assert ENDED_WORD.search(text), text
    assert not re.search(r"\b1 (other )?(jobs|workers|GPUs)\b", text), text


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shapes=st.lists(shape_st, min_size=1, max_size=3), used=used_st)
def test_no_reason_of_any_job_shape_is_malformed(tmp_path: Path, shapes: list[tuple[int, int, bool, str]],
                                                 used: list[int]) -> None:
    """Jobs of 1-6 pods of 1-8 GPUs, size known or not, short or long names, on nodes partly used, placed pod by pod
    as kube-scheduler would: every filter reason, every job's part of an explanation (JobPlans.describe) and the
    whole explanation (Explainer.explain) is one line within its limit with no "None", "the no ", doubled space or
    "1 other jobs", and ends on a whole word, never on "..."."""
    inventory = tmp_path / f"inventory-{uuid.uuid4().hex[:6]}.yaml"
    inventory.write_text(yaml.safe_dump({"nodes": [
        {"name": n, "topology": str(DGX_A100), "labels": {RACK: n[0]}, "used": list(range(u))}
        for n, u in zip(NODES, used, strict=True)]}))
    ext = Extender.standalone(inventory, ExtenderConfig())
    with running(ext) as client:
        for j, (pods, gpus, known, name) in enumerate(shapes):
            ann = {f"{PREFIX}/job": f"{name}-{j}", **({f"{PREFIX}/job-size": str(pods)} if known else {})}
            for i in range(pods):
                pod = gpu_pod(f"p{j}-{i}", gpus, annotations=ann)
                out = client.post("/filter", json=cache_args(pod, NODES)).json()
                for reason in {**out["FailedNodes"], **out["FailedAndUnresolvableNodes"]}.values():
                    _check_reason(reason)
                if not out["NodeNames"]:
                    continue
                node = out["NodeNames"][0]
                if client.post("/bind", json=bind_body(pod, node)).json()["Error"]:
                    continue
                uid = pod["metadata"]["uid"]
                job = ext.jobs.describe(uid)
                assert job is not None and job.startswith("job default/")
                _whole(job, 330)
                assert job.endswith(("may change it", "one rack", "between domains", "pod ring", "host path",
                                     "no all-reduce")), job
                if isinstance(job, Worded):
                    assert job.within(150).endswith(job[-12:])  # shorter, its figure still whole
                entry = ext.cache.nodes[node]
                plan = ext.cache.pods[uid].plan
                assert entry.topo is not None and plan is not None
                gpus_at = sorted(entry.topo.indices_of(plan.ids))
                text = ext.explainer.explain(uid, node, entry.topo, gpus_at, plan.gbps, Need(gpus), job=job)
                _whole(text, MAX_CHARS)
                assert text.endswith(job[-12:]), text
