"""Client of the kubelet's PodResources API v1: which devices the kubelet has handed to which containers.

This is the ground truth of what is allocated on the node (DESIGN.md): the plugin republishes it in the Node's
state annotation so the extender subtracts exactly what the kubelet holds, also after the plugin restarts with no
memory of its own Allocate calls. The kubelet serves it on a unix socket (mount the directory
/var/lib/kubelet/pod-resources, not the file, so a kubelet restart's new socket is seen) and rate-limits it to
100 QPS, burst 10: poll it every few seconds, not in a loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from gpuplugin.proto.podresources.v1 import api_pb2 as pb
from gpuplugin.proto.podresources.v1 import api_pb2_grpc as pb_grpc

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
DEFAULT_TIMEOUT_S = 5.0
# The kubelet's own podresources client takes replies up to 16 MiB (a node with many pods and devices).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class PodResourcesError(Exception):
    """A PodResources call failed. `code` is the gRPC status (UNAVAILABLE when the kubelet socket is absent)."""

    def __init__(self, operation: str, socket_path: str, code: grpc.StatusCode | None, details: str) -> None:
        self.operation = operation
        self.socket_path = socket_path
        self.code = code
        self.details = details
        name = code.name if code is not None else "ERROR"
        super().__init__(f"PodResources {operation} on {socket_path}: {name}: {details}")


@dataclass(frozen=True, slots=True)
class ContainerDevices:
    """One container's devices of one resource."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_ids: tuple[str, ...]


# (namespace, pod) -> container -> resource -> device ids, as the kubelet lists them
KubeletPods = dict[tuple[str, str], dict[str, dict[str, tuple[str, ...]]]]


class PodResourcesClient:
    """List and GetAllocatableResources over the kubelet's socket. One channel, reconnected by gRPC as needed."""

    def __init__(self, socket_path: str = DEFAULT_SOCKET, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout must be positive, got {timeout_s}")
        self.socket_path = socket_path
        self._timeout = timeout_s
        self._channel = grpc.insecure_channel(
            f"unix:{socket_path}",
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
        )
        self._stub = pb_grpc.PodResourcesListerStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> PodResourcesClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fail(self, operation: str, e: grpc.RpcError) -> PodResourcesError:
        code = e.code() if isinstance(e, grpc.Call) else None
        details = (e.details() if isinstance(e, grpc.Call) else str(e)) or "no details"
        return PodResourcesError(operation, self.socket_path, code, details)

    def list(self) -> list[ContainerDevices]:
        """Every (pod, container, resource) with devices, as the kubelet reports them (active pods only)."""
        try:
            reply = self._stub.List(pb.ListPodResourcesRequest(), timeout=self._timeout)
        except grpc.RpcError as e:
            raise self._fail("List", e) from None
        return list(_flatten(reply))

    def pods(self, timeout_s: float | None = None) -> KubeletPods:
        """Every pod the kubelet lists, with or without devices: (namespace, name) -> container -> resource -> ids.

        The kubelet adds a pod to its pod manager just before admitting it, so during an admission the pod being
        admitted is listed with no devices yet for the container being allocated (gpuplugin.plan_watch relies on
        it). `timeout_s` bounds this one call (the kubelet waits on GetPreferredAllocation without a deadline)."""
        try:
            reply = self._stub.List(pb.ListPodResourcesRequest(), timeout=timeout_s or self._timeout)
        except grpc.RpcError as e:
            raise self._fail("List", e) from None
        out: KubeletPods = {}
        for pod in reply.pod_resources:
            containers = out.setdefault((pod.namespace, pod.name), {})
            for container in pod.containers:
                held = containers.setdefault(container.name, {})
                for dev in container.devices:
                    if dev.device_ids:
                        held[dev.resource_name] = (*held.get(dev.resource_name, ()), *dev.device_ids)
        return out

    def allocatable_ids(self, resource: str) -> frozenset[str]:
        """Device ids of `resource` the kubelet can allocate (healthy devices, registered by the plugin)."""
        try:
            reply = self._stub.GetAllocatableResources(pb.AllocatableResourcesRequest(), timeout=self._timeout)
        except grpc.RpcError as e:
            raise self._fail("GetAllocatableResources", e) from None
        return frozenset(i for d in reply.devices if d.resource_name == resource for i in d.device_ids)

    def in_use(self) -> dict[str, set[str]]:
        """Device ids held per resource over every pod's containers (what a sharing config change must keep)."""
        out: dict[str, set[str]] = {}
        for c in self.list():
            out.setdefault(c.resource, set()).update(c.device_ids)
        return out

    def used_ids(self, resource: str) -> frozenset[str]:
        """The union of `resource` device ids over every pod's containers: the node's GPUs in use."""
        return frozenset(i for c in self.list() if c.resource == resource for i in c.device_ids)


def _flatten(reply: pb.ListPodResourcesResponse) -> Iterator[ContainerDevices]:
    for pod in reply.pod_resources:
        for container in pod.containers:
            for dev in container.devices:
                if dev.device_ids:
                    yield ContainerDevices(
                        pod.namespace, pod.name, container.name, dev.resource_name, tuple(dev.device_ids)
                    )
