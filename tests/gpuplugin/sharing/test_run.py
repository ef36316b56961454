"""`gpuplugin run --sharing-config-dir` as it runs on a node (real process, the in-process API server, the kubelet
simulator, PodResources): the node label picks the config, replicas and whole GPUs are advertised side by side,
the Node carries the state's sharing member and the GFD labels, and a shared plan of parent GPUs is honoured."""

from __future__ import annotations

import json
from pathlib import Path

from gputopo.contract import replica_id, replica_parent
from gputopo.core import state_from_json
from tests.fakes.gpunode import gpu_node
from tests.helpers.kube import k8s_pod
from tests.helpers.paths import SHARED
from tests.helpers.polling import eventually

NODE = "dgx1-node"
GPU, SHARED_GPU = "nvidia.com/gpu", "nvidia.com/gpu.shared"
DGX1 = SHARED / "topologies" / "dgx1-v100-ucxpy.txt"
WAIT = 30.0
CONFIG = """version: v1
flags:
  migStrategy: none
sharing:
  timeSlicing:
    renameByDefault: true
    resources:
    - name: nvidia.com/gpu
      replicas: 3
      devices: [4, 5, 6, 7]
"""


def test_run_serves_shared_and_whole_gpus_and_publishes_the_sharing(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "default").write_text("version: v1\n")
    (configs / "inference").write_text(CONFIG)
    with gpu_node(NODE, DGX1, args=["--sharing-config-dir", str(configs), "--sharing-poll-interval", "0.2",
                                    "--pod-resources-poll-interval", "0.2", "--device-id-strategy", "index"]) as node:
        fake, kubelet = node.fake, node.kubelet
        kubelet.wait_for_devices(GPU, 8, WAIT)
        fake.update_node(NODE, lambda n: {**n, "metadata": {**n["metadata"], "labels": {
            **n["metadata"].get("labels", {}), "nvidia.com/device-plugin.config": "inference"}}})
        shared = kubelet.wait_for_devices(SHARED_GPU, 12, WAIT)
        assert {replica_parent(d.id)[0] for d in shared} == {"4", "5", "6", "7"}
        kubelet.wait_for_devices(GPU, 4, WAIT)

        def meta() -> dict:
            return (fake.node(NODE) or {}).get("metadata", {})

        def sharing() -> object:
            text = meta().get("annotations", {}).get("gpu-topology.io/state")
            return state_from_json(text).sharing if text else None

        assert eventually(lambda: sharing() is not None, WAIT), node.log_tail()
        labels = meta()["labels"]
        assert labels["nvidia.com/gpu.replicas"] == "3" and labels["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
        # the extender planned GPUs 5 and 7 (parents) for a 2-replica pod
        plan = {"v": 1, "node": NODE, "resource": SHARED_GPU, "containers": {"main": ["5", "7"]}, "gbps": 10.0}
        fake.add_pod(k8s_pod("infer", 0, NODE, {"gpu-topology.io/plan": json.dumps(plan)}, phase="Pending"))
        node.admitting("infer")  # the kubelet lists the pod just before it asks for its devices
        ids = [d.id for d in shared]
        assert eventually(lambda: sorted(replica_parent(x)[0] for x in kubelet.preferred_raw(SHARED_GPU, ids, [], 2))
                          == ["5", "7"], WAIT), node.log_tail()
        held = [replica_id("5", 0), replica_id("7", 0)]
        resp = kubelet.allocate(SHARED_GPU, held)
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == "5,7"
        node.podres.service.set_pod("default", "infer", {"main": {SHARED_GPU: held}})
        assert eventually(lambda: [(g.gpu, g.used) for g in sharing().resources[0].gpus]  # type: ignore[union-attr]
                          == [("4", 0), ("5", 1), ("6", 0), ("7", 1)], WAIT), node.log_tail()
