"""PodResourcesClient against a real gRPC PodResourcesLister on a unix socket (a fake kubelet)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from gpuplugin.podresources import ContainerDevices, PodResourcesClient, PodResourcesError
from tests.fakes.kubelet_podresources import PodResourcesServer

GPU = "nvidia.com/gpu"


def test_used_ids_are_the_union_over_pods_and_containers_of_that_resource(kubelet: PodResourcesServer) -> None:
    svc = kubelet.service
    svc.set_pod("ml", "train-0", {"main": {GPU: ["GPU-a", "GPU-b"]}, "sidecar": {}})
    svc.set_pod("ml", "train-1", {"init": {GPU: ["GPU-c"]},
                                  "main": {GPU: ["GPU-c", "GPU-d"], "example.com/fpga": ["f0"]}})
    svc.set_pod("web", "nginx", {"nginx": {}})
    with PodResourcesClient(kubelet.socket_path) as client:
        assert client.used_ids(GPU) == {"GPU-a", "GPU-b", "GPU-c", "GPU-d"}
        assert client.used_ids("example.com/fpga") == {"f0"}
        assert client.used_ids("amd.com/gpu") == frozenset()
        assert ContainerDevices("ml", "train-0", "main", GPU, ("GPU-a", "GPU-b")) in client.list()


def test_allocatable_ids_filter_by_resource(kubelet: PodResourcesServer) -> None:
    kubelet.service.set_allocatable(GPU, ["GPU-a", "GPU-b"])
    kubelet.service.set_allocatable("example.com/fpga", ["f0"])
    with PodResourcesClient(kubelet.socket_path) as client:
        assert client.allocatable_ids(GPU) == {"GPU-a", "GPU-b"}


def test_no_kubelet_socket_is_a_typed_unavailable_error(sock_dir: Path) -> None:
    missing = str(sock_dir / "kubelet.sock")
    with PodResourcesClient(missing, timeout_s=2.0) as client, pytest.raises(PodResourcesError) as info:
        client.used_ids(GPU)
    assert info.value.code is grpc.StatusCode.UNAVAILABLE
    assert missing in str(info.value) and "List" in str(info.value)


def test_kubelet_errors_are_typed_with_their_code(kubelet: PodResourcesServer) -> None:
    kubelet.service.fail_next(grpc.StatusCode.RESOURCE_EXHAUSTED)  # the kubelet's rate limit answer
    with PodResourcesClient(kubelet.socket_path) as client:
        with pytest.raises(PodResourcesError) as info:
            client.used_ids(GPU)
        assert info.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.used_ids(GPU) == frozenset()  # and the next call works


def test_the_client_reconnects_after_a_kubelet_restart(sock_dir: Path) -> None:
    path = str(sock_dir / "kubelet.sock")
    with PodResourcesClient(path, timeout_s=2.0) as client:
        with PodResourcesServer(path) as first:
            first.service.set_pod("ml", "a", {"main": {GPU: ["GPU-a"]}})
            assert client.used_ids(GPU) == {"GPU-a"}
        Path(path).unlink(missing_ok=True)
        with PodResourcesServer(path) as second:
            second.service.set_pod("ml", "b", {"main": {GPU: ["GPU-b"]}})
            deadline = time.monotonic() + 10
            while True:  # the first call after the restart may still see the old, broken connection
                try:
                    assert client.used_ids(GPU) == {"GPU-b"}
                    break
                except PodResourcesError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
