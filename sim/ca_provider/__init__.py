"""The project's own cloud for the real Cluster Autoscaler: a gRPC server of CA's `externalgrpc` protocol
(proto/autoscaler/externalgrpc.proto, generated into sim/ca_provider/proto/) whose node groups are simulated GPU
servers of real topologies (fixtures/topologies/*.txt).

CA asks a cloud provider what groups exist, what a new node of a group would look like (for scale from zero),
which group a Node belongs to, and to add or remove nodes. Here:

- a group's template Node carries what `gpuplugin node-template` prints for its topology (the plugin's labels:
  fabric, allreduce-gbps-<k>, gpu-count, and the `--gpu-label` CA reads as the GPU type) and its `nvidia.com/gpu`
  capacity, so CA's simulation fits a pod whose webhook-made node affinity asks an NVLink fabric;
- `NodeGroupIncreaseSize` starts nodes through `start_node`, the caller's way of bringing up a simulated GPU node
  (the tests pass tests.helpers.realnode.real_gpu_node: a Node registered as a kubelet would, the real plugin
  process, the kubelet stand-in), then sets the Node's `spec.providerID` (`gpu-topology-sim://<group>/<name>`), as a
  cloud's node controller does for a kubelet run with `--cloud-provider=external`;
- `NodeGroupDeleteNodes` leaves that context (the plugin and kubelet stand-in stop, the Node is deleted);
  `NodeGroupDecreaseTargetSize` (CA's provision timeout) gives up members that have not registered yet, and only
  those.

What CA is told is decided on state: an instance is running once its Node exists with its providerID (the Nodes
are re-read on every `NodeGroupNodes`), creating before. Sizes are bounded by each group's min and max. Pricing
and per-group options answer UNIMPLEMENTED, which CA accepts (it then uses its defaults).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
import structlog
from google.protobuf import any_pb2

from gpuplugin.commands.node_template import NodeTemplate, build, gpu_label
from gputopo.contract import DEFAULT_KEYS
from gputopo.discovery.loader import load_topology_file
from sim.ca_provider.proto import externalgrpc_pb2 as pb
from sim.ca_provider.proto import externalgrpc_pb2_grpc as pb_grpc
from sim.ca_provider.proto.k8s_io.api.core.v1 import generated_pb2 as core

log = structlog.get_logger(__name__)

GPU = "nvidia.com/gpu"
PROVIDER = "gpu-topology-sim"
DEFAULT_GPU_LABEL = "gpu-topology-sim/accelerator"
Status = pb.InstanceStatus


class Kube(Protocol):
    """What the provider needs of the API server: one call (tests.helpers.controlplane.ControlPlane.request)."""

    def request(self, method: str, path: str, body: Any = None, *, content_type: str = ...,
                ok: Sequence[int] = ..., **params: Any) -> Any: ...


@dataclass(frozen=True)
class NodeGroupSpec:
    """A group of identical GPU servers: the topology of one, and the sizes CA may move it between."""

    id: str
    topology: Path
    min_size: int = 0
    max_size: int = 3
    gpu_type: str = "gpu"  # the GPU label's value: the type CA reports (topology files name no model)
    sharing_config: Path | None = None  # the group's NVIDIA sharing config: its template advertises the replicas
    gpu_label: bool = True  # whether its nodes carry the provider's GPU label (off where replicas are renamed)
    labels: tuple[tuple[str, str], ...] = ()  # more labels its kubelet registers with (a pool that pods select)

    def plugin_args(self) -> tuple[str, ...]:
        """What the plugin on a node of this group is started with, beyond its topology."""
        return ("--sharing-config-file", str(self.sharing_config)) if self.sharing_config is not None else ()


# start_node(name, group, labels) -> a context that keeps a simulated GPU node up while open and removes it on exit
NodeStarter = Callable[[str, NodeGroupSpec, Mapping[str, str]], contextlib.AbstractContextManager[object]]


def provider_id(group: str, name: str) -> str:
    return f"{PROVIDER}://{group}/{name}"


def parse_provider_id(pid: str) -> tuple[str, str] | None:
    """(group, name) of one of our providerIDs, else None (a Node no group of ours owns)."""
    prefix = f"{PROVIDER}://"
    if not pid.startswith(prefix):
        return None
    group, sep, name = pid[len(prefix):].partition("/")
    return (group, name) if sep and group and name else None


def group_template(spec: NodeGroupSpec, gpu_label_key: str = DEFAULT_GPU_LABEL) -> NodeTemplate:
    """What one node of the group carries, by `gpuplugin node-template --topology T --gpu-label KEY=TYPE`'s own
    functions: the plugin's labels and advertised resources, plus the GPU label."""
    template = build(load_topology_file(spec.topology), (), keys=DEFAULT_KEYS, resource_name=GPU,
                     sharing_config=str(spec.sharing_config) if spec.sharing_config is not None else None,
                     mig_strategy=None)
    template = NodeTemplate({**template.labels, **dict(spec.labels)}, template.resources)
    if not spec.gpu_label:
        return template
    key, value = gpu_label(f"{gpu_label_key}={spec.gpu_type}", template.labels, DEFAULT_KEYS.model_label)
    return NodeTemplate({**template.labels, key: value}, template.resources)


@dataclass
class _Member:
    name: str
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    deleting: bool = False
    started: threading.Event = field(default_factory=threading.Event)
    node: object = None  # what start_node's context gave (the tests' RealGpuNode), for a caller that reads it


class SimProvider(pb_grpc.CloudProviderServicer):
    """CA's cloud: groups of simulated GPU servers. `node_resources` are the cpu, memory and pods a started node
    registers with (the template must say the same, or CA's simulation and the cluster disagree)."""

    def __init__(self, kube: Kube, groups: Sequence[NodeGroupSpec], start_node: NodeStarter, *,
                 node_resources: Mapping[str, str], gpu_label_key: str = DEFAULT_GPU_LABEL) -> None:
        self.kube = kube
        self.groups = {g.id: g for g in groups}
        self.templates = {g.id: group_template(g, gpu_label_key) for g in groups}
        self.start_node = start_node
        self.node_resources = dict(node_resources)
        self.gpu_label_key = gpu_label_key
        self._lock = threading.Lock()
        self._members: dict[str, dict[str, _Member]] = {g.id: {} for g in groups}
        self._next: dict[str, int] = {g.id: 0 for g in groups}
        self._threads: list[threading.Thread] = []
        self.errors: list[str] = []  # node starts or stops that failed, for a test's failure message

    # -- the state ------------------------------------------------------------------------------------------------

    def members(self, group: str) -> list[str]:
        """The names of the group's nodes, started or starting, not being deleted."""
        with self._lock:
            return [m.name for m in self._members[group].values() if not m.deleting]

    def started_nodes(self) -> dict[str, object]:
        """Node name -> what start_node gave, for every node started and not being deleted (a benchmark reads the
        kubelet's admissions there)."""
        with self._lock:
            return {m.name: m.node for ms in self._members.values() for m in ms.values()
                    if not m.deleting and m.node is not None}

    def _registered(self) -> dict[str, str]:
        """providerID -> Node name of the Nodes that carry one of ours, as the API server has them now."""
        nodes = self.kube.request("GET", "/api/v1/nodes").get("items") or []
        return {n["spec"]["providerID"]: n["metadata"]["name"] for n in nodes
                if parse_provider_id((n.get("spec") or {}).get("providerID") or "")}

    def _start(self, group: NodeGroupSpec, member: _Member) -> None:
        try:
            if member.deleting:  # given up (NodeGroupDecreaseTargetSize) before its start began
                return
            member.node = member.stack.enter_context(self.start_node(member.name, group,
                                                                     self.templates[group.id].labels))
            if member.deleting:  # given up while starting: it never becomes an instance of the group
                return
            self.kube.request("PATCH", f"/api/v1/nodes/{member.name}",
                              {"spec": {"providerID": provider_id(group.id, member.name)}},
                              content_type="application/merge-patch+json")
        except Exception as e:  # told to CA as the instance's error; the test reads self.errors
            log.exception("sim.ca_provider.start_failed", node=member.name)
            self.errors.append(f"start {member.name}: {e}")
        finally:
            member.started.set()

    def _stop(self, group: str, member: _Member) -> None:
        member.started.wait()
        try:
            member.stack.close()
        except Exception as e:
            log.exception("sim.ca_provider.stop_failed", node=member.name)
            self.errors.append(f"stop {member.name}: {e}")
        with self._lock:
            self._members[group].pop(member.name, None)

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def stop(self) -> None:
        """Stop every node this provider started (teardown)."""
        with self._lock:
            members = [(g, m) for g, ms in self._members.items() for m in ms.values() if not m.deleting]
            for _, m in members:
                m.deleting = True
        for group, member in members:
            self._stop(group, member)
        for thread in list(self._threads):
            thread.join(30)

    # -- the protocol ---------------------------------------------------------------------------------------------

    def _group_message(self, group: NodeGroupSpec) -> pb.NodeGroup:
        return pb.NodeGroup(id=group.id, minSize=group.min_size, maxSize=group.max_size,
                            debug=f"{group.id}: {group.topology.name}, {group.min_size}..{group.max_size}")

    def _group(self, gid: str, context: grpc.ServicerContext) -> NodeGroupSpec:
        if gid not in self.groups:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no node group {gid!r}")
        return self.groups[gid]

    def NodeGroups(self, request: Any, context: grpc.ServicerContext) -> pb.NodeGroupsResponse:
        return pb.NodeGroupsResponse(nodeGroups=[self._group_message(g) for g in self.groups.values()])

    def NodeGroupForNode(self, request: Any, context: grpc.ServicerContext) -> pb.NodeGroupForNodeResponse:
        parsed = parse_provider_id(request.node.providerID)
        if parsed is None or parsed[0] not in self.groups:
            return pb.NodeGroupForNodeResponse(nodeGroup=pb.NodeGroup())  # an empty id: not ours
        return pb.NodeGroupForNodeResponse(nodeGroup=self._group_message(self.groups[parsed[0]]))

    def GPULabel(self, request: Any, context: grpc.ServicerContext) -> pb.GPULabelResponse:
        return pb.GPULabelResponse(label=self.gpu_label_key)

    def GetAvailableGPUTypes(self, request: Any, context: grpc.ServicerContext
                             ) -> pb.GetAvailableGPUTypesResponse:
        return pb.GetAvailableGPUTypesResponse(gpuTypes={g.gpu_type: any_pb2.Any() for g in self.groups.values()})

    def _unimplemented(self, context: grpc.ServicerContext, what: str) -> Any:
        """Pricing and per-group options: CA treats UNIMPLEMENTED as "use the defaults" (said cleanly here, where
        the generated base class would raise and log a traceback per call)."""
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{what}: not offered by {PROVIDER}")

    def PricingNodePrice(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._unimplemented(context, "PricingNodePrice")

    def PricingPodPrice(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._unimplemented(context, "PricingPodPrice")

    def NodeGroupGetOptions(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self._unimplemented(context, "NodeGroupGetOptions")

    def Refresh(self, request: Any, context: grpc.ServicerContext) -> pb.RefreshResponse:
        return pb.RefreshResponse()  # nothing cached: every answer re-reads the state

    def Cleanup(self, request: Any, context: grpc.ServicerContext) -> pb.CleanupResponse:
        return pb.CleanupResponse()  # the nodes outlive CA; the test's teardown calls stop()

    def NodeGroupTargetSize(self, request: Any, context: grpc.ServicerContext
                            ) -> pb.NodeGroupTargetSizeResponse:
        return pb.NodeGroupTargetSizeResponse(targetSize=len(self.members(self._group(request.id, context).id)))

    def NodeGroupIncreaseSize(self, request: Any, context: grpc.ServicerContext
                              ) -> pb.NodeGroupIncreaseSizeResponse:
        group = self._group(request.id, context)
        if request.delta <= 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"delta {request.delta}: must be positive")
        with self._lock:
            size = sum(not m.deleting for m in self._members[group.id].values())
            if size + request.delta > group.max_size:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{group.id}: {size} + {request.delta} exceeds the maximum {group.max_size}")
            new = []
            for _ in range(request.delta):
                member = _Member(f"{group.id}-{self._next[group.id]}")
                self._next[group.id] += 1
                self._members[group.id][member.name] = member
                new.append(member)
        log.info("sim.ca_provider.scaled_up", group=group.id, delta=request.delta, nodes=[m.name for m in new])
        for member in new:
            self._spawn(self._start, group, member)
        return pb.NodeGroupIncreaseSizeResponse()

    def NodeGroupDeleteNodes(self, request: Any, context: grpc.ServicerContext
                             ) -> pb.NodeGroupDeleteNodesResponse:
        group = self._group(request.id, context)
        names = []
        for node in request.nodes:
            parsed = parse_provider_id(node.providerID)
            names.append(parsed[1] if parsed and parsed[0] == group.id else node.name)
        with self._lock:
            members = self._members[group.id]
            unknown = [n for n in names if n not in members or members[n].deleting]
            if unknown:
                context.abort(grpc.StatusCode.NOT_FOUND, f"{group.id} has no node {unknown}")
            size = sum(not m.deleting for m in members.values())
            if size - len(names) < group.min_size:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{group.id}: {size} - {len(names)} is under the minimum {group.min_size}")
            doomed = [members[n] for n in names]
            for m in doomed:
                m.deleting = True
        log.info("sim.ca_provider.scaled_down", group=group.id, nodes=names)
        for member in doomed:
            self._spawn(self._stop, group.id, member)
        return pb.NodeGroupDeleteNodesResponse()

    def NodeGroupDecreaseTargetSize(self, request: Any, context: grpc.ServicerContext
                                    ) -> pb.NodeGroupDecreaseTargetSizeResponse:
        """CA calls this for instances that never registered (its provision timeout, `--max-node-provision-time`):
        the target drops by giving up members still starting, the newest first; their start is stopped (a start
        not begun never begins, one under way is closed once it returns, and never gets its providerID). As CA's
        clouds do, it never removes a registered node (CA deletes those with NodeGroupDeleteNodes): a delta
        reaching one is refused whole, as is a delta that is not negative."""
        group = self._group(request.id, context)
        if request.delta >= 0:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"{group.id}: delta {request.delta}: a decrease must be negative")
        registered = self._registered()
        with self._lock:
            members = [m for m in self._members[group.id].values() if not m.deleting]
            starting = [m for m in members if registered.get(provider_id(group.id, m.name)) != m.name]
            if -request.delta > len(starting):
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{group.id}: delta {request.delta} would remove registered nodes: "
                              f"{len(starting)} of {len(members)} are still starting; delete nodes instead")
            given_up = starting[request.delta:]  # the newest: members keep their creation order
            for m in given_up:
                m.deleting = True
        log.info("sim.ca_provider.target_decreased", group=group.id, delta=request.delta,
                 nodes=[m.name for m in given_up])
        for member in given_up:
            self._spawn(self._stop, group.id, member)
        return pb.NodeGroupDecreaseTargetSizeResponse()

    def NodeGroupNodes(self, request: Any, context: grpc.ServicerContext) -> pb.NodeGroupNodesResponse:
        group = self._group(request.id, context)
        registered = self._registered()
        with self._lock:
            members = list(self._members[group.id].values())
        instances = []
        for m in members:
            pid = provider_id(group.id, m.name)
            state = (Status.instanceDeleting if m.deleting else
                     Status.instanceRunning if registered.get(pid) == m.name else Status.instanceCreating)
            instances.append(pb.Instance(id=pid, status=Status(instanceState=state)))
        return pb.NodeGroupNodesResponse(instances=instances)

    def NodeGroupTemplateNodeInfo(self, request: Any, context: grpc.ServicerContext
                                  ) -> pb.NodeGroupTemplateNodeInfoResponse:
        group = self._group(request.id, context)
        return pb.NodeGroupTemplateNodeInfoResponse(nodeInfo=self.template_node(group.id))

    def template_node(self, gid: str) -> core.Node:
        """A Node as a new member of the group registers: the template's labels, the kubelet's own, capacity =
        allocatable (node resources and the GPUs the plugin advertises), Ready."""
        template = self.templates[gid]
        name = f"template-{gid}"
        node = core.Node()
        node.metadata.name = name
        node.metadata.labels.update({"kubernetes.io/hostname": name, "kubernetes.io/os": "linux",
                                     **template.labels})
        resources = {**self.node_resources, **{k: str(v) for k, v in template.resources.items()}}
        for key, value in resources.items():
            node.status.capacity[key].string = value
            node.status.allocatable[key].string = value
        node.status.conditions.add(type="Ready", status="True", reason="KubeletReady")
        return node


class ProviderServer:
    """SimProvider served on 127.0.0.1:`port` (insecure, as CA's cloud-config without TLS fields expects)."""

    def __init__(self, provider: SimProvider, port: int) -> None:
        self.provider = provider
        self.address = f"127.0.0.1:{port}"
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        pb_grpc.add_CloudProviderServicer_to_server(provider, self.server)
        if self.server.add_insecure_port(self.address) != port:
            raise RuntimeError(f"cannot listen on {self.address}")

    def __enter__(self) -> ProviderServer:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(grace=1).wait(10)
        self.provider.stop()
