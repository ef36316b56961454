"""The DevicePlugin gRPC servicer: translates between the kubelet's messages and the resource manager.

One servicer per server start, so stopping a server ends exactly the streams it carried.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import structlog

from gpuplugin.deviceplugin.errors import AllocationRequestError
from gpuplugin.deviceplugin.resource import ResourceManager, Snapshot, Subscription, brief_ids
from gpuplugin.proto import deviceplugin_pb2 as pb
from gpuplugin.proto import deviceplugin_pb2_grpc as pb_grpc

log = structlog.get_logger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


def plugin_options() -> pb.DevicePluginOptions:
    """The same options go in RegisterRequest and GetDevicePluginOptions (the kubelet uses the latter)."""
    return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)


def to_list_response(snapshot: Snapshot) -> pb.ListAndWatchResponse:
    devices = []
    for state in snapshot:
        dev = state.device
        topology = None
        if dev.numa_node is not None:
            topology = pb.TopologyInfo(nodes=[pb.NUMANode(ID=dev.numa_node)])
        devices.append(pb.Device(ID=dev.id, health=HEALTHY if state.healthy else UNHEALTHY, topology=topology))
    return pb.ListAndWatchResponse(devices=devices)


class DevicePluginServicer(pb_grpc.DevicePluginServicer):
    def __init__(self, manager: ResourceManager) -> None:
        self._manager = manager
        self._lock = threading.Lock()
        self._streams: set[Subscription] = set()
        self._closed = False

    def close(self) -> None:
        """End every ListAndWatch stream of this servicer (before the server stops)."""
        with self._lock:
            self._closed = True
            streams, self._streams = list(self._streams), set()
        for sub in streams:
            self._manager.unsubscribe(sub)

    @property
    def stream_count(self) -> int:
        with self._lock:
            return len(self._streams)

    def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.DevicePluginOptions:
        return plugin_options()

    def ListAndWatch(self, request: pb.Empty, context: grpc.ServicerContext) -> Iterator[pb.ListAndWatchResponse]:
        sub = self._manager.subscribe()
        with self._lock:
            if self._closed:
                self._manager.unsubscribe(sub)
                return
            self._streams.add(sub)
        # The kubelet going away cancels the RPC; wake the waiting generator so the worker thread is freed.
        try:
            if not context.add_callback(sub.close):
                return  # the RPC ended already
            log.info("plugin.listandwatch.opened", peer=context.peer())
            while True:
                snap = sub.next()
                if snap is None:
                    return
                yield to_list_response(snap)
        finally:
            with self._lock:
                self._streams.discard(sub)
            self._manager.unsubscribe(sub)
            log.info("plugin.listandwatch.closed")

    def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        start = time.perf_counter()
        responses = []
        for creq in request.container_requests:
            try:
                pref = self._manager.preferred(
                    list(creq.available_deviceIDs), list(creq.must_include_deviceIDs), creq.allocation_size
                )
                ids = list(pref.ids)
            except Exception:  # an RPC error here fails pod admission; an empty answer costs nothing
                log.exception("plugin.preferred.failed", request=str(creq)[:2000])
                ids = []
            responses.append(pb.ContainerPreferredAllocationResponse(deviceIDs=ids))
        self._manager.metrics.preferred_latency.observe(time.perf_counter() - start)
        return pb.PreferredAllocationResponse(container_responses=responses)

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        responses = []
        for creq in request.container_requests:
            ids = list(creq.devices_ids)
            try:
                alloc = self._manager.allocate(ids)
            except AllocationRequestError as e:
                log.warning("plugin.allocate.refused", devices=brief_ids(ids), error=str(e))
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            log.info("plugin.allocate.done", devices=ids, annotations=alloc.annotations)
            responses.append(
                pb.ContainerAllocateResponse(
                    envs=alloc.envs,
                    annotations=alloc.annotations,
                    devices=[
                        pb.DeviceSpec(container_path=n.path, host_path=n.path, permissions=n.permissions)
                        for n in alloc.device_nodes
                    ],
                    cdi_devices=[pb.CDIDevice(name=name) for name in alloc.cdi_devices],
                )
            )
        return pb.AllocateResponse(container_responses=responses)

    def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()
