"""MIG from end to end across both halves (issue 23): the real `gpuplugin run` replaying an H200 MIG recording
publishes its MIG state on the Node of the in-process API server (islands and NUMA from NVML, the instances pods
hold from PodResources); the extender in cluster mode reads that Node over real HTTP, filters, scores and binds a
`nvidia.com/mig-1g.18gb` pod with kube-scheduler's bodies, writing a plan of MIG UUIDs; the kubelet simulator then
asks the plugin, whose GetPreferredAllocation returns exactly the planned MIG UUID (not the one its own packing
prefers). A node whose every GPU is MIG publishes its state without a topology and takes MIG pods the same way
(under `single` as `nvidia.com/gpu`), and under strategy `none` the Node says why its MIG GPUs are left out."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from extender.config import ExtenderConfig
from extender.service import Extender
from gputopo.contract import mig_none_reason, parse_plan
from gputopo.core import state_from_json
from gputopo.core.codec import NodeState
from gputopo.core.mig import H200_141GB
from gputopo.kube import make_api_client
from tests.extender.conftest import running
from tests.fakes.gpunode import GpuNode, gpu_node
from tests.fixtures.mig_recordings import BALANCED_141
from tests.fixtures.nvml import RECORDINGS
from tests.helpers.kube import k8s_pod
from tests.helpers.mig import mig_recording, write_recording
from tests.helpers.polling import eventually
from tests.helpers.scheduler import bind_body, cache_args

NODE = "h200-mig"
ONE = "nvidia.com/mig-1g.18gb"
GPU = "nvidia.com/gpu"
A100_SINGLE = RECORDINGS / "synthetic-hgx-a100-80gb-8gpu-mig-single.json"
ALL_1G_141 = [("1g.18gb", s, (1,)) for s in range(7)]
WAIT = 30.0  # liveness bound of the waits, never a performance figure
FAST = ["--mig-poll-interval", "0.2", "--sharing-poll-interval", "0.2", "--pod-resources-poll-interval", "0.2"]
# H200 recording: GPU 4 seven 1g.18gb, GPU 5 balanced (2x 1g.18gb, 2g.35gb, 3g.71gb); the others whole
GPU4 = [f"MIG-c204{gi:02x}00-5e7d-4000-8000-00000000{gi - 1:04x}" for gi in range(1, 8)]
GPU5 = [f"MIG-c205{gi:02x}00-5e7d-4000-8000-00000000{gi - 1:04x}" for gi in range(1, 3)]


def _mig_pod(name: str, n: int = 1) -> dict[str, Any]:
    pod = k8s_pod(name, 0)
    pod["spec"]["containers"][0]["resources"] = {"limits": {ONE: str(n)}, "requests": {ONE: str(n)}}
    return pod


def _state(node: GpuNode) -> NodeState | None:
    ann = ((node.fake.node(NODE) or {}).get("metadata", {}).get("annotations") or {})
    text = ann.get("gpu-topology.io/state")
    return state_from_json(text) if text else None


def _annotations(node: GpuNode) -> dict[str, str]:
    return (node.fake.node(NODE) or {}).get("metadata", {}).get("annotations") or {}


@contextmanager
def _extender(node: GpuNode) -> Iterator[tuple[Extender, httpx.Client]]:
    api = make_api_client(host=node.fake.url)
    ext = Extender.cluster(api, ExtenderConfig())
    try:
        with running(ext) as client:
            assert ext.sync is not None and ext.sync.wait_synced(WAIT)
            yield ext, client
    finally:
        api.close()


def _bind(client: httpx.Client, node: GpuNode, pod: dict[str, Any], resource: str = ONE) -> set[str]:
    """The scheduler's filter, prioritize and bind for `pod`; the MIG UUIDs its plan names."""
    added = node.fake.add_pod(pod)
    assert client.post("/filter", json=cache_args(added, [NODE])).json()["NodeNames"] == [NODE]
    assert [h["Host"] for h in client.post("/prioritize", json=cache_args(added, [NODE])).json()] == [NODE]
    assert client.post("/bind", json=bind_body(added, NODE)).json() == {"Error": ""}
    bound = node.fake.pod("default", pod["metadata"]["name"])
    plan = parse_plan(bound["metadata"]["annotations"]["gpu-topology.io/plan"])
    assert bound["spec"]["nodeName"] == NODE and plan.resource == resource and plan.node == NODE
    return set(plan.ids)


def test_a_mig_pod_goes_from_filter_to_the_planned_instance_beside_whole_gpus(tmp_path: Path) -> None:
    recording = write_recording(tmp_path / "rec.json", mig_recording(
        H200_141GB, [None] * 4 + [list(ALL_1G_141), list(BALANCED_141), None, None]))
    with gpu_node(NODE, None, nvml_recording=recording, args=["--mig-strategy", "mixed", *FAST]) as node:
        kubelet = node.kubelet
        devices = kubelet.wait_for_devices(ONE, 9, WAIT)
        kubelet.wait_for_devices("nvidia.com/gpu", 6, WAIT)
        # three of GPU 4's instances are held: GPU 4 is partly used, GPU 5 untouched
        held = GPU4[:3]
        kubelet.allocate(ONE, held)
        node.podres.service.set_pod("default", "notebooks", {"main": {ONE: held}})
        assert eventually(lambda: (s := _state(node)) is not None and s.mig is not None
                          and s.mig.used_ids == set(held), WAIT), node.log_tail()
        state = _state(node)
        assert state is not None and state.mig is not None and state.mig.strategy == "mixed"
        assert "gpu-topology.io/topology" in _annotations(node)
        gpus = {g.index: g for g in state.mig.gpus}
        # one NVSwitch island: each MIG GPU's peers are the six whole GPUs (by advertised id) and the other MIG GPU
        whole = {d.id for d in kubelet.devices("nvidia.com/gpu")}
        assert gpus[4].island == gpus[5].island is not None
        assert set(gpus[4].peers) == whole | {gpus[5].gpu} and set(gpus[5].peers) == whole | {gpus[4].gpu}
        free = [d.id for d in devices if d.id not in held]
        # the plugin's own packing takes GPU 5 (best fit: 2 left there, 4 on GPU 4)
        assert kubelet.preferred_raw(ONE, free, [], 1)[0] in GPU5
        with _extender(node) as (ext, client):
            assert eventually(lambda: NODE in ext.cache.nodes and ext.cache.nodes[NODE].mig is not None
                              and ext.cache.nodes[NODE].mig.used == set(held), WAIT)
            planned = _bind(client, node, _mig_pod("infer"))
            node.admitting("infer")
            # the extender fills the partly used GPU first: a free instance of GPU 4
            assert len(planned) == 1 and planned <= set(GPU4[3:])
            assert eventually(lambda: set(kubelet.preferred_raw(ONE, free, [], 1)) == planned, WAIT), node.log_tail()
            resp = kubelet.allocate(ONE, sorted(planned))
            assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == next(iter(planned))
            node.podres.service.set_pod("default", "infer", {"main": {ONE: sorted(planned)}})
            assert eventually(lambda: ext.reservations.count() == 0, WAIT)
            # a plan that cannot be met (its instance is not available): the plugin answers with its own choice
            others = [x for x in free if x not in planned]
            second = _bind(client, node, _mig_pod("infer-2"))
            node.admitting("infer-2")
            without = [x for x in others if x not in second]
            answer = kubelet.preferred_raw(ONE, without, [], 1)
            assert len(answer) == 1 and answer[0] in without
            assert set(kubelet.preferred_raw(ONE, others, [], 1)) == second  # and the plan again once it can be


def test_an_all_mig_node_publishes_no_topology_and_takes_mig_pods_with_a_plan(tmp_path: Path) -> None:
    recording = write_recording(tmp_path / "rec.json", mig_recording(
        H200_141GB, [list(ALL_1G_141)] * 2 + [list(BALANCED_141)] * 6))
    with gpu_node(NODE, None, nvml_recording=recording, args=["--mig-strategy", "mixed", *FAST]) as node:
        kubelet = node.kubelet
        devices = kubelet.wait_for_devices(ONE, 7 * 2 + 2 * 6, WAIT)
        assert eventually(lambda: (s := _state(node)) is not None and s.mig is not None, WAIT), node.log_tail()
        assert "gpu-topology.io/topology" not in _annotations(node)
        with _extender(node) as (ext, client):
            assert eventually(lambda: NODE in ext.cache.nodes and ext.cache.nodes[NODE].mig is not None, WAIT)
            planned = _bind(client, node, _mig_pod("notebook", 2))
            node.admitting("notebook")
            ids = [d.id for d in devices]
            assert eventually(lambda: set(kubelet.preferred_raw(ONE, ids, [], 2)) == planned, WAIT), node.log_tail()


def test_strategy_none_says_on_the_node_why_its_mig_gpus_are_left_out(tmp_path: Path) -> None:
    recording = write_recording(tmp_path / "rec.json", mig_recording(
        H200_141GB, [None] * 6 + [list(ALL_1G_141), list(BALANCED_141)]))
    with gpu_node(NODE, None, nvml_recording=recording, args=["--mig-strategy", "none", *FAST]) as node:
        node.kubelet.wait_for_devices("nvidia.com/gpu", 6, WAIT)
        assert eventually(lambda: (s := _state(node)) is not None and s.mig is not None, WAIT), node.log_tail()
        state = _state(node)
        assert state is not None and state.mig is not None
        assert state.mig.strategy == "none" and state.mig.reason == mig_none_reason(2)
        assert all(i.resource is None for g in state.mig.gpus for i in g.instances)
        assert set(node.kubelet.resources()) == {"nvidia.com/gpu"}


def test_single_serves_mig_instances_as_nvidia_gpu_and_the_plan_names_them() -> None:
    """Under `single` the instances are `nvidia.com/gpu` (every GPU MIG, one profile): the plan of a pod asking
    nvidia.com/gpu lists MIG UUIDs, and the plugin's answer is that plan."""
    with gpu_node(NODE, None, nvml_recording=A100_SINGLE, args=["--mig-strategy", "single", *FAST]) as node:
        kubelet = node.kubelet
        devices = [d.id for d in kubelet.wait_for_devices(GPU, 56, WAIT)]
        assert eventually(lambda: (s := _state(node)) is not None and s.mig is not None, WAIT), node.log_tail()
        assert _state(node).mig.strategy == "single" and "gpu-topology.io/topology" not in _annotations(node)
        with _extender(node) as (ext, client):
            assert eventually(lambda: NODE in ext.cache.nodes and ext.cache.nodes[NODE].mig is not None, WAIT)
            planned = _bind(client, node, k8s_pod("whole-ish", 2), resource=GPU)
            node.admitting("whole-ish")
            assert len(planned) == 2 and all(x.startswith("MIG-") for x in planned)
            assert eventually(lambda: set(kubelet.preferred_raw(GPU, devices, [], 2)) == planned, WAIT), \
                node.log_tail()
