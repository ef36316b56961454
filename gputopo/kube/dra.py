"""resource.k8s.io/v1 calls of a DRA driver on the official client's ResourceV1Api: ResourceSlice create, replace,
delete, delete-collection, and ResourceClaim get; replies decoded into plain dicts (list and watch of slices go
through fetching.list_objects and watching.Watcher with kind "resourceslices")."""

from __future__ import annotations

from typing import Any

import kubernetes.client

from gputopo.kube.client import call_json, request_timeout
from gputopo.kube.errors import KubeArgumentError


def _api(api: kubernetes.client.ApiClient) -> kubernetes.client.ResourceV1Api:
    return kubernetes.client.ResourceV1Api(api)


def _need(what: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise KubeArgumentError(f"{what} must be a non-empty string, got {value!r}")
    return value


def create_slice(api: kubernetes.client.ApiClient, body: dict[str, Any]) -> dict[str, Any]:
    """POST a ResourceSlice (metadata.name or generateName set) -> the created object."""
    return call_json("create resourceslice", _api(api).create_resource_slice, body,
                     _request_timeout=request_timeout(api))


def replace_slice(api: kubernetes.client.ApiClient, name: str, body: dict[str, Any]) -> dict[str, Any]:
    """PUT a ResourceSlice; a metadata.resourceVersion in `body` makes a stale write a Conflict."""
    _need("slice name", name)
    return call_json(f"replace resourceslice {name}", _api(api).replace_resource_slice, name, body,
                     _request_timeout=request_timeout(api))


def delete_slice(api: kubernetes.client.ApiClient, name: str) -> dict[str, Any]:
    _need("slice name", name)
    return call_json(f"delete resourceslice {name}", _api(api).delete_resource_slice, name,
                     _request_timeout=request_timeout(api))


def delete_slices(api: kubernetes.client.ApiClient, field_selector: str) -> dict[str, Any]:
    """DELETE the collection of slices that `field_selector` selects (what the kubelet does at its start)."""
    _need("field selector", field_selector)
    return call_json(f"delete resourceslices {field_selector}", _api(api).delete_collection_resource_slice,
                     field_selector=field_selector, _request_timeout=request_timeout(api))


def get_claim(api: kubernetes.client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    _need("namespace", namespace)
    _need("claim name", name)
    return call_json(f"get resourceclaim {namespace}/{name}", _api(api).read_namespaced_resource_claim, name,
                     namespace, _request_timeout=request_timeout(api))
