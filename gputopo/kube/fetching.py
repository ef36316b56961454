"""GET and paginated LIST of Nodes, Pods and the objects of any API group (`ApiResource`), decoded into plain dicts.

Lists follow `continue` pages so 5,000 nodes never arrive as one giant reply; if a continue token expires (410) the
list restarts once without a limit, as client-go's pager does, so the caller still gets one consistent snapshot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import kubernetes.client
import structlog

from gputopo.kube.client import call_json, request_timeout
from gputopo.kube.errors import Gone, KubeApiError, KubeArgumentError

log = structlog.get_logger(__name__)

Kind = Literal["nodes", "pods", "resourceslices"]
KINDS: tuple[str, ...] = ("nodes", "pods", "resourceslices")


@dataclass(frozen=True, slots=True)
class ApiResource:
    """A resource of a named API group, listed across namespaces through /apis/<group>/<version>/<plural> (custom
    resources of CRDs and built-in alpha APIs alike, which the generated typed clients may not know)."""

    group: str
    version: str
    plural: str
    kind: str  # of one object: "PodGroup"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    def __str__(self) -> str:
        return f"{self.plural}.{self.group}"


def _need_name(what: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise KubeArgumentError(f"{what} must be a non-empty string, got {value!r}")
    return value


def list_method(api: kubernetes.client.ApiClient, kind: str | ApiResource,
                namespace: str | None) -> Callable[..., Any]:
    """The generated list/watch method for a kind (KINDS or an ApiResource), namespaced when `namespace` is given."""
    if isinstance(kind, ApiResource):
        custom = kubernetes.client.CustomObjectsApi(api)
        if namespace:
            ns = _need_name("namespace", namespace)
            return lambda **kw: custom.list_namespaced_custom_object(kind.group, kind.version, ns, kind.plural, **kw)
        return lambda **kw: custom.list_cluster_custom_object(kind.group, kind.version, kind.plural, **kw)
    core = kubernetes.client.CoreV1Api(api)
    if kind == "resourceslices":
        if namespace:
            raise KubeArgumentError("resourceslices are cluster-scoped: namespace must be None")
        return kubernetes.client.ResourceV1Api(api).list_resource_slice
    if kind == "nodes":
        if namespace:
            raise KubeArgumentError("nodes are cluster-scoped: namespace must be None")
        return core.list_node
    if kind == "pods":
        if namespace:
            ns = _need_name("namespace", namespace)
            return lambda **kw: core.list_namespaced_pod(ns, **kw)
        return core.list_pod_for_all_namespaces
    raise KubeArgumentError(f"kind must be one of {KINDS}, got {kind!r}")


def get_node(api: kubernetes.client.ApiClient, name: str) -> dict[str, Any]:
    """One Node as the apiserver's JSON dict. Raises NotFound, Forbidden, ApiUnavailable, ..."""
    _need_name("node name", name)
    core = kubernetes.client.CoreV1Api(api)
    return call_json(f"get node {name}", core.read_node, name, _request_timeout=request_timeout(api))


def get_pod(api: kubernetes.client.ApiClient, namespace: str, name: str) -> dict[str, Any]:
    """One Pod as the apiserver's JSON dict. Raises NotFound, Forbidden, ApiUnavailable, ..."""
    _need_name("namespace", namespace)
    _need_name("pod name", name)
    core = kubernetes.client.CoreV1Api(api)
    return call_json(
        f"get pod {namespace}/{name}", core.read_namespaced_pod, name, namespace, _request_timeout=request_timeout(api)
    )


def list_objects(
    api: kubernetes.client.ApiClient,
    kind: str | ApiResource,
    *,
    namespace: str | None = None,
    field_selector: str | None = None,
    label_selector: str | None = None,
    limit: int | None = 500,
) -> tuple[list[dict[str, Any]], str]:
    """All objects of `kind` matching the selectors, following continue pages -> (items, list resourceVersion).

    Items are the list's item dicts (as the apiserver sends them: without kind/apiVersion).
    """
    if limit is not None and (not isinstance(limit, int) or limit <= 0):
        raise KubeArgumentError(f"limit must be a positive int or None, got {limit!r}")
    method = list_method(api, kind, namespace)
    scope = f"{kind}" + (f" in {namespace}" if namespace else "")
    operation = f"list {scope}"
    selectors: dict[str, Any] = {}
    if field_selector:
        selectors["field_selector"] = field_selector
    if label_selector:
        selectors["label_selector"] = label_selector
    timeout = request_timeout(api)

    items: list[dict[str, Any]] = []
    token: str | None = None
    page_limit = limit
    restarted = False
    while True:
        kwargs = dict(selectors, _request_timeout=timeout)
        if page_limit is not None:
            kwargs["limit"] = page_limit
        if token:
            kwargs["_continue"] = token
        try:
            page = call_json(operation, method, **kwargs)
        except Gone:
            if not token or restarted:
                raise
            # The snapshot behind the token was compacted: start over with one unpaged list.
            log.warning("kube.list.continue_expired", kind=kind, namespace=namespace, pages_read=len(items))
            items, token, page_limit, restarted = [], None, None, True
            continue
        page_items = page.get("items")
        meta = page.get("metadata")
        if not isinstance(meta, dict) or not isinstance(page_items, (list, type(None))):
            raise KubeApiError(
                200,
                "MalformedResponse",
                f"list reply has no metadata/items: keys {sorted(page)}",
                page,
                operation=operation,
            )
        items.extend(i for i in (page_items or ()) if isinstance(i, dict))
        token = meta.get("continue") or None
        if not token:
            return items, str(meta.get("resourceVersion") or "")


def list_nodes(
    api: kubernetes.client.ApiClient,
    *,
    label_selector: str | None = None,
    field_selector: str | None = None,
    limit: int | None = 500,
) -> tuple[list[dict[str, Any]], str]:
    """All Nodes (optionally filtered), every page -> (items, resourceVersion to watch from)."""
    return list_objects(api, "nodes", field_selector=field_selector, label_selector=label_selector, limit=limit)


def list_pods(
    api: kubernetes.client.ApiClient,
    *,
    namespace: str | None = None,
    field_selector: str | None = None,
    label_selector: str | None = None,
    limit: int | None = 500,
) -> tuple[list[dict[str, Any]], str]:
    """All Pods (all namespaces unless `namespace`), every page -> (items, resourceVersion to watch from)."""
    return list_objects(
        api, "pods", namespace=namespace, field_selector=field_selector, label_selector=label_selector, limit=limit
    )
