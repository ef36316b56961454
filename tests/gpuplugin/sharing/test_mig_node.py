"""The MIG node in-process, over a replayed NVML (the replay backend's recording swapped for a re-partition) and
real registrations with the kubelet simulator: health per instance reaches ListAndWatch, the reason MIG GPUs are
left out is there for the publisher, and a re-partition re-advertises without restarting anything."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuplugin.commands.run import Discovered, start_health
from gpuplugin.config import PluginConfig
from gpuplugin.deviceplugin.lifecycle import PluginRunner
from gpuplugin.deviceplugin.resource import ResourceManager
from gpuplugin.plan_watch import PlanWatch
from gpuplugin.sharing.mig_node import MigNode
from gpuplugin.sharing.mig_strategy import MigStrategy
from gputopo.core.mig import H100_80GB
from gputopo.discovery.nvml import discover_node
from gputopo.discovery.nvml_replay import ReplayNvmlBackend, load_event_stream
from gputopo.discovery.recording import parse_recording
from sim.kubelet import KubeletSimulator
from tests.fakes.kubeapi import FakeKubeApi
from tests.fixtures.nvml import EVENTS, RECORDINGS, canonical, load_json
from tests.helpers.kube import k8s_pod
from tests.helpers.mig import ALL_1G, mig_recording
from tests.helpers.polling import eventually

H100_MIXED = RECORDINGS / "synthetic-hgx-h100-80gb-8gpu-mig-mixed.json"
ONE, TWO, THREE = "nvidia.com/mig-1g.10gb", "nvidia.com/mig-2g.20gb", "nvidia.com/mig-3g.40gb"
WAIT = 20.0
NS = "ERR:NVMLError_NotSupported:Not Supported"


def mig_node(backend: ReplayNvmlBackend, plugin_dir: Path, strategy: MigStrategy) -> MigNode:
    gpus = [(m.nvml_index, m.uuid) for m in discover_node(backend).mig if m.enabled]

    def serve(m: ResourceManager, resource: str, socket: str) -> PluginRunner:
        return PluginRunner(m, plugin_dir, resource, socket, backoff_initial=0.05, backoff_max=0.5).start()

    return MigNode(backend, gpus, whole_gpus=4, whole_resource="nvidia.com/gpu", whole_socket="gpu-topology.sock",
                   serve=serve, strategy=strategy, poll_interval_s=0.1)


@pytest.fixture
def replay() -> Iterator[ReplayNvmlBackend]:
    backend = ReplayNvmlBackend(canonical(H100_MIXED), load_event_stream(load_json(EVENTS / "mig-instance-xids.json")))
    backend.init()
    yield backend
    backend.shutdown()


def test_instance_xids_turn_exactly_those_advertised_instances_unhealthy(
        replay: ReplayNvmlBackend, plugin_dir: Path, kubelet: KubeletSimulator) -> None:
    node = mig_node(replay, plugin_dir, MigStrategy.MIXED).start()
    cfg = PluginConfig(health_recovery="never", health_probe_interval=0.5)
    monitor = start_health(cfg, Discovered(None, backend=replay), None, node)
    try:
        assert replay.wait_drained(WAIT)
        # GPU 5's GI 3 (its 2g.20gb) by an instance Xid; GPU 6 by a GPU-wide one (both its 3g.40gb); GPU 7's GI 3
        # is split in 1c compute instances, which mixed does not advertise
        expected = {"MIG-b1050300-5e7d-4000-8000-000000000002", "MIG-b1060100-5e7d-4000-8000-000000000000",
                    "MIG-b1060200-5e7d-4000-8000-000000000001"}

        def bad() -> set[str]:
            return {d.id for r in (ONE, TWO, THREE) for d in kubelet.devices(r) if not d.healthy}

        assert eventually(lambda: bad() == expected, WAIT), bad()
        assert expected <= monitor.unhealthy_instances()
        assert set(node.unhealthy_ids()) == expected  # what the publisher puts in the state's "unhealthy"
        assert kubelet.wait_for_devices(ONE, 10, WAIT)
    finally:
        monitor.stop()
        node.stop()


def test_none_keeps_mig_gpus_out_with_a_reason_and_a_repartition_is_seen_without_a_restart(
        plugin_dir: Path, kubelet: KubeletSimulator) -> None:
    backend = ReplayNvmlBackend(canonical(H100_MIXED))
    backend.init()
    node = mig_node(backend, plugin_dir, MigStrategy.NONE).start()
    try:
        status = node.status()
        assert node.served() == {} and status.strategy is MigStrategy.NONE and status.strategy_from == "setting"
        reason = status.reason()
        assert reason is not None and reason.startswith("mig strategy none: 4 left out")
        assert "GPU-b1000004-5e7d-4000-8000-000000000004: MIG enabled" in reason
        node.setting = MigStrategy.MIXED
        assert eventually(lambda: node.status().resources.keys() >= {ONE, TWO, THREE}, WAIT)
        # a resource is served a moment before its registration reaches the kubelet
        assert eventually(lambda: kubelet.registrations(ONE) >= 1, WAIT)
        registrations = kubelet.registrations(ONE)
        # GPUs 5-7 re-partitioned all-1g.10gb: NVML shows it, the node re-advertises on the same registrations
        backend.replace(parse_recording(mig_recording(H100_80GB, [None] * 3 + ["pending"] + [list(ALL_1G)] * 4)))
        assert eventually(lambda: sum(d.healthy for d in kubelet.devices(ONE)) == 28, WAIT)
        assert kubelet.registrations(ONE) == registrations
        assert eventually(lambda: set(node.status().resources) == {ONE}, WAIT)
        assert node.status().reason() is None
    finally:
        node.stop()
        backend.shutdown()


def _planned(node: str, resource: str, ids: list[str]) -> str:
    return json.dumps({"v": 1, "node": node, "resource": resource, "containers": {"main": ids}, "gbps": 0.0})


def test_each_mig_resource_takes_its_own_plans_also_after_a_repartition_adds_it(
        plugin_dir: Path, kubelet: KubeletSimulator, fake: FakeKubeApi, api: Any) -> None:
    """The PlanWatch set once on the MIG node reaches every MIG resource's GetPreferredAllocation, also one a
    re-partition creates later; a plan the request cannot meet is passed over for the node's own choice."""
    backend = ReplayNvmlBackend(canonical(H100_MIXED))
    backend.init()
    node = mig_node(backend, plugin_dir, MigStrategy.MIXED).start()
    watch = PlanWatch(api, "n1", backoff_initial_s=0.02, backoff_max_s=0.1,
                      shared_resources=node.resource_names).start()
    try:
        assert watch.wait_synced(WAIT)
        node.set_plan_source(watch)
        ones = [d.id for d in kubelet.wait_for_devices(ONE, 10, WAIT)]
        own = kubelet.preferred_raw(ONE, ones, [], 1)
        wanted = next(x for x in sorted(ones) if x not in own)  # not what the node would pick itself
        fake.add_pod(k8s_pod("infer", 0, "n1", {"gpu-topology.io/plan": _planned("n1", ONE, [wanted])}))
        assert eventually(lambda: kubelet.preferred_raw(ONE, ones, [], 1) == [wanted], WAIT)
        # the planned instance is not among those offered: the node's own choice, no error
        rest = [x for x in ones if x != wanted]
        answer = kubelet.preferred_raw(ONE, rest, [], 1)
        assert len(answer) == 1 and answer[0] in rest
        # GPUs 4-7 re-partitioned as one 7g.80gb each: a new resource, its plans served without a new watch
        backend.replace(parse_recording(mig_recording(H100_80GB, [None] * 4 + [[("7g.80gb", 0, (7,))]] * 4)))
        sevens = [d.id for d in kubelet.wait_for_devices("nvidia.com/mig-7g.80gb", 4, WAIT)]
        target = sorted(sevens)[-1]
        assert kubelet.preferred_raw("nvidia.com/mig-7g.80gb", sevens, [], 1) != [target]  # own choice: lowest
        fake.add_pod(k8s_pod("train", 0, "n1",
                             {"gpu-topology.io/plan": _planned("n1", "nvidia.com/mig-7g.80gb", [target])}))
        assert eventually(lambda: kubelet.preferred_raw("nvidia.com/mig-7g.80gb", sevens, [], 1) == [target], WAIT)
    finally:
        node.set_plan_source(None)
        watch.stop()
        node.stop()
        backend.shutdown()


def test_mig_devices_advertise_their_parent_gpus_numa_node_from_sysfs_when_nvml_has_none(
        plugin_dir: Path, kubelet: KubeletSimulator) -> None:
    """NVML answers NotSupported for the NUMA node on the H200 (as in this recording); the kernel's sysfs
    numa_node of the parent GPU is what the Topology Manager gets, as for whole GPUs. NVML's answer, where there is
    one, comes first; -1 (none) advertises no node."""
    rec = canonical(H100_MIXED)
    for gpu, (nvml, sysfs) in {4: (NS, 0), 5: (NS, 1), 6: (NS, -1), 7: (3, 2)}.items():
        rec["gpus"][gpu]["numa_node"], rec["gpus"][gpu]["sysfs_numa_node"] = nvml, sysfs
    backend = ReplayNvmlBackend(rec)
    backend.init()
    node = mig_node(backend, plugin_dir, MigStrategy.MIXED).start()
    try:
        parent = {i.uuid: i.nvml_index for insts in node.served().values() for i in insts}
        expected = {u: {4: (0,), 5: (1,), 6: (), 7: (3,)}[g] for u, g in parent.items()}
        assert {g for g in parent.values()} == {4, 5, 6, 7}

        def advertised() -> dict[str, tuple[int, ...]]:
            return {d.id: d.numa_nodes for r in node.resource_names() for d in kubelet.devices(r)}

        assert eventually(lambda: advertised() == expected, WAIT), advertised()
    finally:
        node.stop()
        backend.shutdown()
