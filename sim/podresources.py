"""The kubelet's PodResources service, simulated: a real gRPC server on a unix socket serving the pods and devices
set on it (by a test, or by sim.admission as it admits pods the way the kubelet does)."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc

from gpuplugin.proto.podresources.v1 import api_pb2 as pb
from gpuplugin.proto.podresources.v1 import api_pb2_grpc as pb_grpc

Containers = dict[str, dict[str, list[str]]]  # container -> resource -> device ids


class FakePodResources(pb_grpc.PodResourcesListerServicer):
    """Pods and allocatable devices are set by the caller; `fail_next` answers the next calls with an error."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pods: dict[tuple[str, str], Containers] = {}
        self._allocatable: dict[str, list[str]] = {}
        self._failures: list[grpc.StatusCode] = []
        self.list_calls = 0

    def set_pod(self, namespace: str, name: str, containers: Containers) -> None:
        with self._lock:
            self._pods[(namespace, name)] = containers

    def remove_pod(self, namespace: str, name: str) -> None:
        with self._lock:
            self._pods.pop((namespace, name), None)

    def set_allocatable(self, resource: str, ids: list[str]) -> None:
        with self._lock:
            self._allocatable[resource] = list(ids)

    def fail_next(self, code: grpc.StatusCode, n: int = 1) -> None:
        with self._lock:
            self._failures.extend([code] * n)

    def _maybe_fail(self, context: grpc.ServicerContext) -> None:
        with self._lock:
            code = self._failures.pop(0) if self._failures else None
        if code is not None:
            context.abort(code, "injected by the test")

    def _pod(self, key: tuple[str, str], containers: Containers) -> pb.PodResources:
        return pb.PodResources(
            namespace=key[0], name=key[1],
            containers=[
                pb.ContainerResources(name=c, devices=[
                    pb.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in resources.items()
                ])
                for c, resources in containers.items()
            ],
        )

    def List(self, request: pb.ListPodResourcesRequest, context: grpc.ServicerContext) -> pb.ListPodResourcesResponse:
        self._maybe_fail(context)
        with self._lock:
            self.list_calls += 1
            pods = [self._pod(k, v) for k, v in sorted(self._pods.items())]
        return pb.ListPodResourcesResponse(pod_resources=pods)

    def GetAllocatableResources(self, request: pb.AllocatableResourcesRequest,
                                context: grpc.ServicerContext) -> pb.AllocatableResourcesResponse:
        self._maybe_fail(context)
        with self._lock:
            devices = [pb.ContainerDevices(resource_name=r, device_ids=ids) for r, ids in self._allocatable.items()]
        return pb.AllocatableResourcesResponse(devices=devices)


class PodResourcesServer:
    """Serves a FakePodResources on `socket_path` until stopped (context manager)."""

    def __init__(self, socket_path: str, service: FakePodResources | None = None) -> None:
        self.socket_path = socket_path
        self.service = service or FakePodResources()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_PodResourcesListerServicer_to_server(self.service, self._server)
        self._server.add_insecure_port(f"unix:{socket_path}")

    def __enter__(self) -> PodResourcesServer:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(None).wait(5)
