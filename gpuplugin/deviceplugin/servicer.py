"""The DevicePlugin gRPC servicer (grpc.aio): translates between the kubelet's messages and the resource manager.

One servicer per server start, so stopping a server ends exactly the streams it carried. A ListAndWatch stream is
a coroutine waiting on its subscription, so open streams hold no thread and cannot starve the calls pod admission
and registration depend on (GetDevicePluginOptions, GetPreferredAllocation, Allocate); their number is bounded
anyway (`max_streams`), extras refused with RESOURCE_EXHAUSTED. The unary calls run on the event loop itself:
the allocator answers from its prewarmed memo in microseconds (a cold search costs milliseconds, 90 at 72 GPUs),
and a hop to a thread pool measured slower (GetPreferredAllocation p99 1.9 ms against 1.0 inline).
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator

import grpc
import structlog

from gpuplugin.deviceplugin.errors import AllocationRequestError
from gpuplugin.deviceplugin.resource import ResourceManager, Snapshot, Subscription, brief_ids
from gpuplugin.proto import deviceplugin_pb2 as pb
from gpuplugin.proto import deviceplugin_pb2_grpc as pb_grpc
from gputopo.logs import Repeats

log = structlog.get_logger(__name__)

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
# The kubelet holds one stream, a restarting kubelet briefly two; the rest is room for debugging tools.
DEFAULT_MAX_STREAMS = 16


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
    def __init__(self, manager: ResourceManager, max_streams: int = DEFAULT_MAX_STREAMS) -> None:
        if max_streams < 1:
            raise ValueError(f"max_streams must be at least 1 (the kubelet's stream), got {max_streams}")
        self._manager = manager
        self.max_streams = max_streams
        self._lock = threading.Lock()
        self._streams: set[Subscription] = set()
        self._closed = False
        self._refusals = Repeats(manager.log_interval_s, manager.clock)

    def close(self) -> None:
        """End every ListAndWatch stream of this servicer (before the server stops). Any thread."""
        with self._lock:
            self._closed = True
            streams, self._streams = list(self._streams), set()
        for sub in streams:
            self._manager.unsubscribe(sub)

    @property
    def stream_count(self) -> int:
        with self._lock:
            return len(self._streams)

    async def GetDevicePluginOptions(self, request: pb.Empty, context: grpc.aio.ServicerContext
                                     ) -> pb.DevicePluginOptions:
        return plugin_options()

    def _open_stream(self) -> Subscription | None:
        """A subscription counted against the bound, or None when the bound is reached or the server is closing."""
        with self._lock:
            if self._closed or len(self._streams) >= self.max_streams:
                return None
            sub = self._manager.subscribe()
            self._streams.add(sub)
            return sub

    async def ListAndWatch(self, request: pb.Empty, context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[pb.ListAndWatchResponse]:
        sub = self._open_stream()
        if sub is None:
            if self._closed:
                return
            self._manager.metrics.streams_refused.inc()
            if (quiet := self._refusals.admit()) is not None:
                log.warning("plugin.listandwatch.refused", peer=context.peer(), open=self.max_streams,
                            not_logged_since_last=quiet)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.max_streams} ListAndWatch streams are open already, the most this plugin "
                                "serves; close one first")
        assert sub is not None
        self._manager.metrics.streams.inc()
        log.debug("plugin.listandwatch.opened", peer=context.peer())  # per stream: a churning client floods info
        try:
            while True:
                snap = await sub.next_async()
                if snap is None:
                    return
                yield to_list_response(snap)
        finally:  # also on cancellation: the kubelet going away cancels this coroutine
            with self._lock:
                self._streams.discard(sub)
            self._manager.unsubscribe(sub)
            self._manager.metrics.streams.dec()
            log.debug("plugin.listandwatch.closed")

    def _preferred(self, request: pb.PreferredAllocationRequest) -> pb.PreferredAllocationResponse:
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

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreferredAllocationResponse:
        return self._preferred(request)

    def _allocate(self, request: pb.AllocateRequest) -> pb.AllocateResponse:
        responses = []
        for creq in request.container_requests:
            ids = list(creq.devices_ids)
            try:
                alloc = self._manager.allocate(ids)
            except AllocationRequestError as e:
                log.warning("plugin.allocate.refused", devices=brief_ids(ids), error=str(e))
                raise
            log.debug("plugin.allocate.done", devices=ids, annotations=alloc.annotations)  # per request
            responses.append(
                pb.ContainerAllocateResponse(
                    envs=alloc.envs,
                    annotations=alloc.annotations,
                    devices=[
                        pb.DeviceSpec(container_path=n.path, host_path=n.path, permissions=n.permissions)
                        for n in alloc.device_nodes
                    ],
                    cdi_devices=[pb.CDIDevice(name=name) for name in alloc.cdi_devices],
                    mounts=[pb.Mount(container_path=m.container_path, host_path=m.host_path, read_only=m.read_only)
                            for m in alloc.mounts],
                )
            )
        return pb.AllocateResponse(container_responses=responses)

    async def Allocate(self, request: pb.AllocateRequest, context: grpc.aio.ServicerContext) -> pb.AllocateResponse:
        try:
            return self._allocate(request)
        except AllocationRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise  # abort raises; this line is never reached

    async def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: grpc.aio.ServicerContext
    ) -> pb.PreStartContainerResponse:
        return pb.PreStartContainerResponse()
