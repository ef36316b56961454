"""Feeds the node cache from the apiserver: a Watcher on Nodes, one on Pods (list, watch, re-list on 410), and one on
each kind of group object and of job owner object that sizes jobs (extender.membership.groups,
extender.membership.ownership), where it exists: a kind that is not installed or not granted is looked for again
every `group_retry_s`, quietly."""

from __future__ import annotations

import time
from typing import Any

import kubernetes.client
import structlog

from extender.membership.groups import GROUP_RESOURCES
from extender.state.cache import NodeCache
from extender.state.slices import CLAIMS, SLICES, DraView
from gputopo.kube import SYNC, Watcher
from gputopo.kube.fetching import ApiResource, list_pods
from gputopo.kube.watching import WatchMetrics

log = structlog.get_logger(__name__)

# Finished pods hold no GPUs; the apiserver sends DELETED when a watched pod stops matching the selector.
POD_FIELD_SELECTOR = "status.phase!=Succeeded,status.phase!=Failed"


class ClusterSync:
    def __init__(
        self,
        api: kubernetes.client.ApiClient,
        cache: NodeCache,
        *,
        pod_field_selector: str | None = POD_FIELD_SELECTOR,
        watch_timeout_s: int = 300,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        metrics: WatchMetrics | None = None,
        group_retry_s: float = 300.0,
        dra: DraView | None = None,
    ) -> None:
        self.api = api
        self.cache = cache
        self._complete = False
        common: dict[str, Any] = {"timeout_seconds": watch_timeout_s, "backoff_initial_s": backoff_initial_s,
                                  "backoff_max_s": backoff_max_s, "metrics": metrics}
        self.nodes = Watcher(api, "nodes", self._on_node, name="extender-nodes", **common)
        self.pods = Watcher(api, "pods", self._on_pod, field_selector=pod_field_selector, name="extender-pods",
                            **common)
        self.groups = [Watcher(api, r, self._group_callback(r), name=f"extender-{r.plural}-{r.group}",
                               absent_retry_s=group_retry_s, **common) for r in GROUP_RESOURCES]
        # DRA nodes (extender.state.slices): our driver's ResourceSlices and every ResourceClaim, where served and
        # granted (absent otherwise, like the groups)
        self.dra: list[Watcher] = []
        if dra is not None:
            self.dra = [Watcher(api, SLICES, self._dra_callback(dra.sync_slices, dra.apply_slice),
                                name="extender-resourceslices", absent_retry_s=group_retry_s, **common),
                        Watcher(api, CLAIMS, self._dra_callback(dra.sync_claims, dra.apply_claim),
                                name="extender-resourceclaims", absent_retry_s=group_retry_s, **common)]
        self.owners: list[Watcher] = []  # the job owner kinds chosen (--job-owner-kinds), absent like the groups
        for r in cache.owners.resources:
            self.owners.append(Watcher(api, r, self._owner_callback(r, len(self.owners)),
                                       name=f"extender-{r.plural}-{r.version}-{r.group}",
                                       absent_retry_s=group_retry_s, **common))

    def start(self) -> None:
        for w in self.watchers():
            w.start()

    def stop(self) -> None:
        for w in reversed(self.watchers()):
            w.stop()

    def watchers(self) -> list[Watcher]:
        return [self.nodes, self.pods, *self.groups, *self.owners, *self.dra]

    def not_synced(self) -> str | None:
        """Which watches have not delivered their first list yet (None: all have). Every kind counts: the group and
        job owner kinds size jobs, the DRA kinds rank DRA nodes. A kind not served or not granted counts as listed
        (empty) once the apiserver said so, so waiting ends for those too."""
        if self._complete:  # a watcher never unlists: asked on every verb, answered once
            return None
        waiting = [w.label for w in self.watchers() if not w.synced]
        if waiting:
            return f"the view is not complete yet: waiting for the first list of {', '.join(waiting)}"
        self._complete = True
        return None

    @property
    def synced(self) -> bool:
        return self.not_synced() is None

    def wait_synced(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        return all(w.wait_synced(None if deadline is None else max(0.0, deadline - time.monotonic()))
                   for w in self.watchers())

    def confirm_node(self, node: str) -> list[str]:
        """Read the pods bound to `node` from the apiserver now (a consistent list, not the watch) and drop from the
        cache those gone from it or terminal (NodeCache.confirm_node_pods); the uids dropped. Raises KubeApiError.
        For a preemptor kube-scheduler retries the moment it sees its victims go, which the pod watch here may not
        have delivered yet."""
        return self.cache.confirm_node_pods(
            node, lambda: list_pods(self.api, field_selector=f"spec.nodeName={node}")[0])

    def _on_node(self, event_type: str, obj: dict[str, Any]) -> None:
        if event_type == SYNC:
            self.cache.sync_nodes(obj.get("items") or [])
        elif event_type == "DELETED":
            name = (obj.get("metadata") or {}).get("name")
            if isinstance(name, str):
                self.cache.remove_node(name)
        else:
            self.cache.update_node(obj)

    def _on_pod(self, event_type: str, obj: dict[str, Any]) -> None:
        if event_type == SYNC:
            self.cache.sync_pods(obj.get("items") or [])
        elif event_type == "DELETED":
            uid = (obj.get("metadata") or {}).get("uid")
            if isinstance(uid, str):
                self.cache.remove_pod(uid)
        else:
            self.cache.update_pod(obj)

    def _group_callback(self, resource: ApiResource) -> Any:
        def on_group(event_type: str, obj: dict[str, Any]) -> None:
            if event_type == SYNC:
                self.cache.groups.sync(resource, obj.get("items") or [])
            else:
                self.cache.groups.apply(resource, event_type, obj)

        return on_group

    @staticmethod
    def _dra_callback(sync: Any, apply: Any) -> Any:
        def on_dra(event_type: str, obj: dict[str, Any]) -> None:
            if event_type == SYNC:
                sync(obj.get("items") or [])
            else:
                apply(event_type, obj)

        return on_dra

    def _owner_callback(self, resource: ApiResource, i: int) -> Any:
        def on_owner(event_type: str, obj: dict[str, Any]) -> None:
            if event_type == SYNC:  # an absent kind delivers an empty one, its watcher saying why
                self.cache.owners.sync(resource, obj.get("items") or [], self.owners[i].absent)
            else:
                self.cache.owners.apply(resource, event_type, obj)

        return on_owner
