"""Metadata patches of Nodes and Pods as JSON merge patches (RFC 7386).

Merge patch, not the client's default strategic merge: it means the same thing on every apiserver and `None`
deletes a key, which is how stale annotations and labels are removed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import kubernetes.client

from gputopo.kube.client import call_json, request_timeout
from gputopo.kube.errors import KubeArgumentError

MERGE_PATCH = "application/merge-patch+json"


def _string_map(what: str, values: Mapping[str, str | None] | None) -> dict[str, str | None] | None:
    if values is None:
        return None
    if not isinstance(values, Mapping):
        raise KubeArgumentError(f"{what} must be a mapping of str to str|None, got {type(values).__name__}")
    out: dict[str, str | None] = {}
    for key, value in values.items():
        if not isinstance(key, str) or not key:
            raise KubeArgumentError(f"{what} key must be a non-empty string, got {key!r}")
        if value is not None and not isinstance(value, str):
            raise KubeArgumentError(f"{what}[{key!r}] must be a string or None, got {type(value).__name__}")
        out[key] = value
    return out


def metadata_patch(
    *,
    annotations: Mapping[str, str | None] | None = None,
    labels: Mapping[str, str | None] | None = None,
    resource_version: str | None = None,
) -> dict[str, Any]:
    """The merge-patch body; a resource_version makes the apiserver refuse (409) if the object changed since."""
    meta: dict[str, Any] = {}
    ann = _string_map("annotations", annotations)
    lab = _string_map("labels", labels)
    if ann:
        meta["annotations"] = ann
    if lab:
        meta["labels"] = lab
    if resource_version is not None:
        if not isinstance(resource_version, str) or not resource_version:
            raise KubeArgumentError(f"resource_version must be a non-empty string, got {resource_version!r}")
        meta["resourceVersion"] = resource_version
    return {"metadata": meta}


def patch_node_metadata(
    api: kubernetes.client.ApiClient,
    name: str,
    *,
    annotations: Mapping[str, str | None] | None = None,
    labels: Mapping[str, str | None] | None = None,
    resource_version: str | None = None,
) -> dict[str, Any]:
    """Merge-patch a Node's annotations/labels (None removes a key) -> the updated Node dict.

    Raises NotFound, Conflict (stale resource_version), Invalid (bad label value), Forbidden, ApiUnavailable, ...
    """
    if not isinstance(name, str) or not name:
        raise KubeArgumentError(f"node name must be a non-empty string, got {name!r}")
    body = metadata_patch(annotations=annotations, labels=labels, resource_version=resource_version)
    core = kubernetes.client.CoreV1Api(api)
    return call_json(
        f"patch node {name}",
        core.patch_node,
        name,
        body,
        _content_type=MERGE_PATCH,
        _request_timeout=request_timeout(api),
    )


def patch_pod_annotations(
    api: kubernetes.client.ApiClient,
    namespace: str,
    name: str,
    annotations: Mapping[str, str | None],
    *,
    resource_version: str | None = None,
) -> dict[str, Any]:
    """Merge-patch a Pod's annotations (None removes a key) -> the updated Pod dict."""
    for what, value in (("namespace", namespace), ("pod name", name)):
        if not isinstance(value, str) or not value:
            raise KubeArgumentError(f"{what} must be a non-empty string, got {value!r}")
    body = metadata_patch(annotations=annotations, resource_version=resource_version)
    core = kubernetes.client.CoreV1Api(api)
    return call_json(
        f"patch pod {namespace}/{name}",
        core.patch_namespaced_pod,
        name,
        namespace,
        body,
        _content_type=MERGE_PATCH,
        _request_timeout=request_timeout(api),
    )
