"""Shared GPUs from end to end (issue 22): the real `gpuplugin run` with NVIDIA's time-slicing file publishes its
replicas on the Node, the extender in cluster mode reads them from the same API server, filters, scores and binds
a 2-replica pod over HTTP with kube-scheduler's bodies, and the kubelet simulator then asks the plugin: its
GetPreferredAllocation returns replicas of exactly the GPUs the extender planned, and Allocate gives the container
those physical GPUs once each. Then the kubelet restarts with the pod held, and the node keeps serving."""

from __future__ import annotations

from pathlib import Path

from extender.config import ExtenderConfig
from extender.service import Extender
from gputopo.contract import parse_plan, replica_parent
from gputopo.core import state_from_json
from gputopo.kube import make_api_client
from tests.extender.conftest import running
from tests.fakes.gpunode import gpu_node
from tests.helpers.kube import k8s_pod
from tests.helpers.paths import SHARED
from tests.helpers.polling import eventually
from tests.helpers.scheduler import bind_body, cache_args

NODE = "dgx1-node"
GPU, REPLICA = "nvidia.com/gpu", "nvidia.com/gpu.shared"
DGX1 = SHARED / "topologies" / "dgx1-v100-ucxpy.txt"
WAIT = 30.0  # liveness bound of the waits, never a performance figure
# NVIDIA's documented time-slicing file, with `devices` (which NVIDIA's plugin strips): GPUs 4-7 shared, 0-3 whole.
CONFIG = """version: v1
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
    - name: nvidia.com/gpu
      replicas: 4
      devices: [4, 5, 6, 7]
"""


def _shared_pod(name: str, n: int) -> dict:
    pod = k8s_pod(name, 0)
    pod["spec"]["containers"][0]["resources"] = {"limits": {REPLICA: str(n)}, "requests": {REPLICA: str(n)}}
    return pod


def test_a_shared_pod_goes_from_filter_to_allocate_on_the_gpus_the_extender_planned(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "default").write_text(CONFIG)
    args = ["--sharing-config-dir", str(configs), "--sharing-poll-interval", "0.2", "--pod-resources-poll-interval",
            "0.2", "--device-id-strategy", "index"]
    with gpu_node(NODE, DGX1, args=args) as node:
        fake, kubelet = node.fake, node.kubelet
        replicas = kubelet.wait_for_devices(REPLICA, 16, WAIT)
        kubelet.wait_for_devices(GPU, 4, WAIT)

        def state():
            text = ((fake.node(NODE) or {}).get("metadata", {}).get("annotations") or {}).get("gpu-topology.io/state")
            return state_from_json(text) if text else None

        assert eventually(lambda: state() is not None and state().sharing is not None, WAIT), node.log_tail()
        api = make_api_client(host=fake.url)
        ext = Extender.cluster(api, ExtenderConfig())
        try:
            with running(ext) as client:
                assert ext.sync is not None and ext.sync.wait_synced(WAIT)
                assert eventually(lambda: NODE in ext.cache.nodes and ext.cache.nodes[NODE].sharing is not None,
                                  WAIT)
                pod = fake.add_pod(_shared_pod("infer", 2))
                assert client.post("/filter", json=cache_args(pod, [NODE])).json()["NodeNames"] == [NODE]
                scores = client.post("/prioritize", json=cache_args(pod, [NODE])).json()
                assert [h["Host"] for h in scores] == [NODE]
                assert client.post("/bind", json=bind_body(pod, NODE)).json() == {"Error": ""}
                bound = fake.pod("default", "infer")
                plan = parse_plan(bound["metadata"]["annotations"]["gpu-topology.io/plan"])
                assert bound["spec"]["nodeName"] == NODE and plan.resource == REPLICA
                assert len(plan.ids) == 2 and plan.ids <= {"4", "5", "6", "7"}  # two distinct shared GPUs
                ids = [d.id for d in replicas]
                assert eventually(lambda: {replica_parent(x)[0] for x in kubelet.preferred_raw(REPLICA, ids, [], 2)}
                                  == set(plan.ids), WAIT), node.log_tail()
                held = kubelet.preferred_raw(REPLICA, ids, [], 2)
                resp = kubelet.allocate(REPLICA, held)
                assert sorted(resp.envs["NVIDIA_VISIBLE_DEVICES"].split(",")) == sorted(plan.ids)
                node.podres.service.set_pod("default", "infer", {"main": {REPLICA: held}})
                assert eventually(lambda: sum(g.used for g in state().sharing.resources[0].gpus) == 2, WAIT)
                # the extender settles its reservation once the node publishes the replicas used
                assert eventually(lambda: ext.reservations.count() == 0, WAIT)
                # a kubelet restart with the shared pod held: the plugin registers both resources again
                kubelet.restart()
                assert len(kubelet.wait_for_devices(REPLICA, 16, WAIT)) == 16
                assert len(kubelet.wait_for_devices(GPU, 4, WAIT)) == 4
                again = client.post("/filter", json=cache_args(_shared_pod("next", 2), [NODE])).json()
                assert again["NodeNames"] == [NODE]
        finally:
            api.close()
