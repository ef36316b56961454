"""Metadata patches of Nodes and Pods as JSON merge patches (RFC 7386).

Merge patch, not the client's default strategic merge: it means the same thing on every apiserver and `None`
deletes a key, which is how stale annotations and labels are removed.

Also what a Node tells the people running the cluster without anyone reading a log (both shown by `kubectl describe
node`): a condition in its status and a core/v1 Event about it. Events go to the `default` namespace, where the
kubelet records a Node's own, so they are listed beside the kubelet's. A condition is written with a strategic merge
patch of nodes/status (the one place it is used here): the apiserver merges `conditions` by `type`, so the kubelet's
conditions (Ready, ...) and a concurrent heartbeat are left alone.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import kubernetes.client

from gputopo.kube.client import call_json, request_timeout
from gputopo.kube.errors import KubeArgumentError

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
NODE_EVENT_NAMESPACE = "default"
_MESSAGE_MAX = 1024  # the apiserver refuses longer Event messages


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


# --- what a Node tells people: its condition, an Event about it ---------------------------------------------


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def post_node_event(api: kubernetes.client.ApiClient, node: Mapping[str, Any], *, reason: str, message: str,
                    component: str, event_type: str = "Warning") -> dict[str, Any]:
    """Create one Event about `node` (a Node dict, for its name and uid) -> the created Event. Raises
    KubeApiError (Forbidden without `create` on events)."""
    meta = node.get("metadata") or {}
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise KubeArgumentError(f"node name must be a non-empty string, got {name!r}")
    now = _now()
    body = {
        "apiVersion": "v1",
        "kind": "Event",
        # a unique name per call, as client-go's recorder makes them: "<object>.<hex>"
        "metadata": {"generateName": f"{name}.", "namespace": NODE_EVENT_NAMESPACE},
        "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": name, "uid": meta.get("uid") or name},
        "reason": reason,
        "message": message[:_MESSAGE_MAX],
        "type": event_type,
        "source": {"component": component, "host": os.environ.get("NODE_NAME") or socket.gethostname()},
        "reportingComponent": component,
        "reportingInstance": name,
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    core = kubernetes.client.CoreV1Api(api)
    return call_json(f"create event for node {name}", core.create_namespaced_event, NODE_EVENT_NAMESPACE, body,
                     _request_timeout=request_timeout(api))


def node_condition(node: Mapping[str, Any], condition_type: str) -> dict[str, Any] | None:
    """The condition of that type the Node carries now, or None."""
    for c in (node.get("status") or {}).get("conditions") or ():
        if isinstance(c, dict) and c.get("type") == condition_type:
            return c
    return None


def patch_node_condition(api: kubernetes.client.ApiClient, name: str, *, condition_type: str, status: bool,
                         reason: str, message: str, transitioned: bool = True) -> dict[str, Any]:
    """Set one condition on the Node's status -> the updated Node. `transitioned`: the status differs from the one
    the Node carried, so lastTransitionTime moves (a new message alone keeps it)."""
    if not isinstance(name, str) or not name:
        raise KubeArgumentError(f"node name must be a non-empty string, got {name!r}")
    now = _now()
    condition: dict[str, Any] = {"type": condition_type, "status": "True" if status else "False", "reason": reason,
                                 "message": message[:_MESSAGE_MAX], "lastHeartbeatTime": now}
    if transitioned:
        condition["lastTransitionTime"] = now
    core = kubernetes.client.CoreV1Api(api)
    return call_json(f"patch status of node {name}", core.patch_node_status, name,
                     {"status": {"conditions": [condition]}}, _content_type=STRATEGIC_MERGE_PATCH,
                     _request_timeout=request_timeout(api))
