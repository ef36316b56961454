"""The externalgrpc provider the real-Cluster-Autoscaler tier runs (sim.ca_provider), without CA: its generated
code is current and its protos are the shared ones, its templates are `gpuplugin node-template`'s, and over a real
gRPC channel it answers CA's calls from its state (sizes bounded, instances running only once their Node carries
the providerID, foreign Nodes not claimed)."""

from __future__ import annotations

import contextlib
import importlib.util
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from gputopo.contract import DEFAULT_KEYS, NVLINK_FABRICS
from sim.ca_provider import DEFAULT_GPU_LABEL, NodeGroupSpec, ProviderServer, SimProvider, group_template
from sim.ca_provider.proto import externalgrpc_pb2 as pb
from sim.ca_provider.proto import externalgrpc_pb2_grpc as pb_grpc
from sim.ports import free_port
from tests.extender.conftest import A100, PCIE
from tests.helpers.autoscaler import AUTOSCALER_SHARED
from tests.helpers.paths import REPO
from tests.helpers.polling import eventually

GROUPS = (NodeGroupSpec("pcie", PCIE, 0, 2, gpu_type="rtx5090"), NodeGroupSpec("nvswitch", A100, 0, 2, gpu_type="a100"))
RESOURCES = {"cpu": "64", "memory": "512Gi", "pods": "250"}
RUNNING = pb.InstanceStatus.instanceRunning
CREATING = pb.InstanceStatus.instanceCreating


def test_generated_code_is_current(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("gen_ca_proto", REPO / "scripts" / "gen_ca_proto.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    gen.generate(tmp_path)
    package = Path("sim", "ca_provider", "proto")
    fresh = {p.relative_to(tmp_path): p.read_bytes() for p in (tmp_path / package).rglob("*.py")}
    committed = {p.relative_to(REPO): p.read_bytes() for p in (REPO / package).rglob("*.py")}
    assert sorted(fresh) == sorted(committed), "generated file set differs: run scripts/gen_ca_proto.py"
    assert not [str(p) for p in fresh if fresh[p] != committed[p]], "stale: run scripts/gen_ca_proto.py"


def test_the_copied_protos_are_the_shared_ones() -> None:
    """proto/autoscaler/ is a copy of shared/autoscaler/protos/ (proto/autoscaler/SOURCES.md), byte for byte."""
    shared = AUTOSCALER_SHARED / "protos"
    if not shared.is_dir():
        pytest.skip(f"no {shared} to compare with (the shared directory beside the clone)")
    ours = REPO / "proto" / "autoscaler"
    theirs = {p.relative_to(shared): p.read_bytes() for p in shared.rglob("*.proto")}
    assert {p.relative_to(ours): p.read_bytes() for p in ours.rglob("*.proto")} == theirs


def test_the_template_ca_reads_is_what_node_template_prints() -> None:
    """Scale from zero fits pods only on what the template says: the plugin's labels and GPU count as
    `gpuplugin node-template` computes them, the GPU label CA is told of, and a node's cpu, memory and pods."""
    provider = SimProvider(_Kube(), GROUPS, _Starter(_Kube()), node_resources=RESOURCES)
    node = provider.template_node("nvswitch")
    labels = dict(node.metadata.labels)
    assert labels[DEFAULT_KEYS.fabric_label] in NVLINK_FABRICS and labels[DEFAULT_GPU_LABEL] == "a100"
    assert {k: v for k, v in labels.items() if not k.startswith("kubernetes.io/")} == group_template(GROUPS[1]).labels
    assert node.status.allocatable["nvidia.com/gpu"].string == "8" and node.status.capacity["memory"].string == "512Gi"
    assert [(c.type, c.status) for c in node.status.conditions] == [("Ready", "True")]
    assert dict(provider.template_node("pcie").metadata.labels)[DEFAULT_KEYS.fabric_label] == "pcie"


class _Kube:
    """The API server as far as the provider uses it: Nodes, listed and patched."""

    def __init__(self) -> None:
        self.nodes: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()

    def request(self, method: str, path: str, body: Any = None, *, content_type: str = "application/json",
                ok: Sequence[int] = (200,), **params: Any) -> Any:
        with self.lock:
            if (method, path) == ("GET", "/api/v1/nodes"):
                return {"items": [dict(n) for n in self.nodes.values()]}
            assert method == "PATCH" and path.startswith("/api/v1/nodes/"), (method, path)
            self.nodes[path.rsplit("/", 1)[1]]["spec"].update(body["spec"])
            return None


class _Starter:
    """start_node: registers a Node (no providerID yet, as a kubelet does) and removes it on exit."""

    def __init__(self, kube: _Kube) -> None:
        self.kube = kube
        self.started: list[str] = []
        self.stopped: list[str] = []
        self.gate = threading.Event()
        self.gate.set()

    @contextlib.contextmanager
    def __call__(self, name: str, group: NodeGroupSpec, labels: Mapping[str, str]) -> Iterator[None]:
        self.gate.wait(10)
        with self.kube.lock:
            self.kube.nodes[name] = {"metadata": {"name": name, "labels": dict(labels)}, "spec": {}}
        self.started.append(name)
        try:
            yield
        finally:
            with self.kube.lock:
                self.kube.nodes.pop(name, None)
            self.stopped.append(name)


@pytest.fixture
def served() -> Iterator[tuple[pb_grpc.CloudProviderStub, _Starter]]:
    kube = _Kube()
    starter = _Starter(kube)
    port = free_port()
    with ProviderServer(SimProvider(kube, GROUPS, starter, node_resources=RESOURCES), port), \
            grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield pb_grpc.CloudProviderStub(channel), starter


def _states(stub: pb_grpc.CloudProviderStub, group: str) -> dict[str, int]:
    return {i.id: i.status.instanceState for i in stub.NodeGroupNodes(pb.NodeGroupNodesRequest(id=group)).instances}


def test_a_scale_up_is_creating_until_its_node_carries_the_provider_id(
        served: tuple[pb_grpc.CloudProviderStub, _Starter]) -> None:
    stub, starter = served
    assert [(g.id, g.minSize, g.maxSize) for g in stub.NodeGroups(pb.NodeGroupsRequest()).nodeGroups] == [
        ("pcie", 0, 2), ("nvswitch", 0, 2)]
    assert stub.GPULabel(pb.GPULabelRequest()).label == DEFAULT_GPU_LABEL
    starter.gate.clear()  # the node is still coming up
    stub.NodeGroupIncreaseSize(pb.NodeGroupIncreaseSizeRequest(id="nvswitch", delta=1))
    pid = "gpu-topology-sim://nvswitch/nvswitch-0"
    assert _states(stub, "nvswitch") == {pid: CREATING}
    assert stub.NodeGroupTargetSize(pb.NodeGroupTargetSizeRequest(id="nvswitch")).targetSize == 1
    starter.gate.set()
    assert eventually(lambda: _states(stub, "nvswitch") == {pid: RUNNING}), _states(stub, "nvswitch")
    node = pb.ExternalGrpcNode(providerID=pid, name="nvswitch-0")
    assert stub.NodeGroupForNode(pb.NodeGroupForNodeRequest(node=node)).nodeGroup.id == "nvswitch"
    foreign = pb.ExternalGrpcNode(providerID="", name="pcie-static")
    assert stub.NodeGroupForNode(pb.NodeGroupForNodeRequest(node=foreign)).nodeGroup.id == ""
    stub.NodeGroupDeleteNodes(pb.NodeGroupDeleteNodesRequest(id="nvswitch", nodes=[node]))
    assert eventually(lambda: starter.stopped == ["nvswitch-0"] and not _states(stub, "nvswitch"))


def test_sizes_stay_within_the_group_bounds(served: tuple[pb_grpc.CloudProviderStub, _Starter]) -> None:
    stub, starter = served
    with pytest.raises(grpc.RpcError) as too_many:
        stub.NodeGroupIncreaseSize(pb.NodeGroupIncreaseSizeRequest(id="pcie", delta=3))
    assert too_many.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as unknown:
        stub.NodeGroupTargetSize(pb.NodeGroupTargetSizeRequest(id="tpu"))
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as priced:
        stub.PricingNodePrice(pb.PricingNodePriceRequest())
    assert priced.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert not starter.started


def test_decreasing_the_target_gives_up_only_nodes_that_never_registered(
        served: tuple[pb_grpc.CloudProviderStub, _Starter]) -> None:
    """CA's provision timeout: the target drops by the members still starting (newest first), which never become
    instances; a delta reaching a registered node, or one not negative, is refused whole."""
    stub, starter = served
    stub.NodeGroupIncreaseSize(pb.NodeGroupIncreaseSizeRequest(id="pcie", delta=1))
    running = "gpu-topology-sim://pcie/pcie-0"
    assert eventually(lambda: _states(stub, "pcie") == {running: RUNNING}), _states(stub, "pcie")
    starter.gate.clear()  # the next node never comes up while the gate is closed
    stub.NodeGroupIncreaseSize(pb.NodeGroupIncreaseSizeRequest(id="pcie", delta=1))
    assert _states(stub, "pcie") == {running: RUNNING, "gpu-topology-sim://pcie/pcie-1": CREATING}
    for delta in (-2, 0, 1):
        with pytest.raises(grpc.RpcError) as refused:
            stub.NodeGroupDecreaseTargetSize(pb.NodeGroupDecreaseTargetSizeRequest(id="pcie", delta=delta))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, delta
        assert "\n" not in (refused.value.details() or "")
    assert stub.NodeGroupTargetSize(pb.NodeGroupTargetSizeRequest(id="pcie")).targetSize == 2
    stub.NodeGroupDecreaseTargetSize(pb.NodeGroupDecreaseTargetSizeRequest(id="pcie", delta=-1))
    assert stub.NodeGroupTargetSize(pb.NodeGroupTargetSizeRequest(id="pcie")).targetSize == 1
    starter.gate.set()  # the start under way returns: it is closed at once and never gets the providerID
    assert eventually(lambda: "pcie-1" in starter.stopped), starter.stopped
    assert _states(stub, "pcie") == {running: RUNNING}
    assert starter.stopped == ["pcie-1"]
    with pytest.raises(grpc.RpcError) as registered:  # the only member left is registered
        stub.NodeGroupDecreaseTargetSize(pb.NodeGroupDecreaseTargetSizeRequest(id="pcie", delta=-1))
    assert "registered" in (registered.value.details() or "")
