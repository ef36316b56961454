"""POST pods/binding: put a pod on a node and write its annotations in the same atomic update.

The Binding carries the pod's uid in metadata.uid, as kube-scheduler does: the apiserver uses it as a
precondition, so a pod deleted and recreated under the same name is not bound by a stale decision (409).
"""

from __future__ import annotations

from collections.abc import Mapping

import kubernetes.client
import structlog

from gputopo.kube.client import call_raw, decode_json_response, request_timeout
from gputopo.kube.errors import KubeApiError, KubeArgumentError

log = structlog.get_logger(__name__)


def bind_pod(
    api: kubernetes.client.ApiClient,
    *,
    namespace: str,
    name: str,
    uid: str | None,
    node: str,
    annotations: Mapping[str, str] | None = None,
) -> None:
    """Bind namespace/name to `node`, merging `annotations` into the pod atomically with spec.nodeName.

    Raises Conflict (already bound, uid mismatch, being deleted), NotFound (no such pod), Forbidden,
    ApiUnavailable, or another KubeApiError.
    """
    for what, value in (("namespace", namespace), ("pod name", name), ("node", node)):
        if not isinstance(value, str) or not value:
            raise KubeArgumentError(f"{what} must be a non-empty string, got {value!r}")
    if uid is not None and (not isinstance(uid, str) or not uid):
        raise KubeArgumentError(f"uid must be a non-empty string or None, got {uid!r}")
    ann = dict(annotations or {})
    for key, value in ann.items():
        if not isinstance(key, str) or not key or not isinstance(value, str):
            raise KubeArgumentError(f"annotations must map non-empty str to str, got {key!r}: {value!r}")
    body = kubernetes.client.V1Binding(
        api_version="v1",
        kind="Binding",
        metadata=kubernetes.client.V1ObjectMeta(name=name, namespace=namespace, uid=uid, annotations=ann or None),
        target=kubernetes.client.V1ObjectReference(api_version="v1", kind="Node", name=node),
    )
    operation = f"bind pod {namespace}/{name} to {node}"
    core = kubernetes.client.CoreV1Api(api)
    # _preload_content=False: the reply is a Status, which the client would fail to read as a V1Binding.
    resp = call_raw(
        operation, core.create_namespaced_pod_binding, name, namespace, body, _request_timeout=request_timeout(api)
    )
    status = decode_json_response(resp, operation=operation)
    if status.get("kind") == "Status" and status.get("status") not in (None, "Success"):
        raise KubeApiError(
            int(status.get("code") or resp.status),
            str(status.get("reason") or "Unknown"),
            str(status.get("message") or "binding not successful"),
            status,
            operation=operation,
        )
    log.info("kube.pod.bound", namespace=namespace, pod=name, node=node, annotations=sorted(ann))
