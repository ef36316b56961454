"""Takes off a Node what the plugin put on it, so an uninstalled product or an opted-out node is left as it was.

Why it exists: the plugin's labels and annotations outlive it. Most are only stale, but the autoscaler hold
(`cluster-autoscaler.kubernetes.io/scale-down-disabled`, `karpenter.sh/do-not-disrupt`) left behind pins the node
for ever: no autoscaler removes it again.

What is removed, and nothing else (gputopo.contract.Keys lists them):
- the annotations `<prefix>/topology`, `<prefix>/state`, `<prefix>/autoscaler-hold`;
- of the autoscaler annotations, only those `<prefix>/autoscaler-hold` names and that still carry our value: a hold
  someone else set, or changed since, stays (gpuplugin.autoscaler_hold.release);
- the labels fabric, gpu-model, gpu-count, allreduce-gbps-<k>, free-gpus.<resource>; with `gfd_labels` also the
  GPU Feature Discovery labels the plugin writes for its sharing layout (off by default: GFD may be their writer),
  and only on a Node GFD does not label (no nvidia.com/gfd.timestamp): there they are GFD's, as the plugin's
  default (auto) leaves them.
The admin's opt-in label `<prefix>/device-plugin` is never touched.

Each removal is decided on the Node as it is read, sent conditional on that version (a 409 re-reads), and read
again afterwards: the loop ends when the fresh Node carries nothing of ours.

When the plugin stops, `leave_if_opted_out` decides whether its node opted out: the plugin's own Pod (the
DaemonSet's copy of its node selector and required node affinity) no longer matches the Node's labels. A restart
or an upgrade leaves the Node matching, and the keys stay; an unknown answer (no Pod found, API errors) keeps them
too, since keys removed by mistake lift a hold on a busy node.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import kubernetes.client
import structlog

from gpuplugin.autoscaler_hold import release
from gputopo.contract import Keys
from gputopo.kube.errors import Conflict, KubeApiError, NotFound
from gputopo.kube.fetching import get_node, list_objects
from gputopo.kube.patching import patch_node_metadata
from gputopo.podspec import affinity_matches as pod_fits_node  # the DaemonSet controller's test, kube-scheduler's rule
from gputopo.retry import Backoff

log = structlog.get_logger(__name__)

DEFAULT_ATTEMPTS = 8


class CleanupError(RuntimeError):
    """The Node still carried keys of ours after every attempt (it kept changing under us, or a write failed)."""

    def __init__(self, node: str, left: Sequence[str], cause: str) -> None:
        super().__init__(f"node {node}: still carries {', '.join(sorted(left))} ({cause})")
        self.node = node
        self.left = tuple(left)


@dataclass(frozen=True)
class Removal:
    """What one Node carries of ours: annotations and labels to delete (merge-patch None)."""

    annotations: dict[str, None]
    labels: dict[str, None]

    @property
    def keys(self) -> list[str]:
        return sorted([*self.annotations, *self.labels])

    def __bool__(self) -> bool:
        return bool(self.annotations or self.labels)


def gfd_label_keys() -> tuple[str, ...]:
    from gpuplugin.sharing.labels import MPS_CAPABLE, PRODUCT, REPLICAS, STRATEGY

    return (REPLICAS, STRATEGY, PRODUCT, MPS_CAPABLE)


def gfd_runs_on(node: Mapping[str, Any]) -> bool:
    from gpuplugin.sharing.labels import GFD_TIMESTAMP

    return GFD_TIMESTAMP in ((node.get("metadata") or {}).get("labels") or {})


def owned_on(node: Mapping[str, Any], keys: Keys, *, gfd_labels: bool = False) -> Removal:
    """The keys of ours this Node carries now (a pure function of the Node)."""
    meta = node.get("metadata") or {}
    annotations: Mapping[str, str] = meta.get("annotations") or {}
    labels: Mapping[str, str] = meta.get("labels") or {}
    ann: dict[str, None] = {k: None for k in keys.published_annotations if k in annotations}
    ann.update(release(keys.autoscaler_hold, annotations))
    gfd = gfd_label_keys() if gfd_labels and not gfd_runs_on(node) else ()
    lab: dict[str, None] = {k: None for k in labels if keys.is_published_label(k) or k in gfd}
    return Removal(ann, lab)


def remove_published(api: kubernetes.client.ApiClient, node_name: str, keys: Keys, *, gfd_labels: bool = False,
                     attempts: int = DEFAULT_ATTEMPTS) -> list[str]:
    """Remove our keys from one Node -> the keys removed ([] when it carried none or does not exist). Raises
    CleanupError when keys are left after `attempts`, KubeApiError for a failure a retry does not mend (403)."""
    removed: list[str] = []
    cause = "no attempt"
    backoff = Backoff(0.2, 2.0, jitter_s=0.0)
    for _ in range(attempts):
        try:
            node = get_node(api, node_name)
        except NotFound:
            return removed
        removal = owned_on(node, keys, gfd_labels=gfd_labels)
        if not removal:
            return removed
        try:
            patch_node_metadata(api, node_name, annotations=removal.annotations or None,
                                labels=removal.labels or None,
                                resource_version=(node.get("metadata") or {}).get("resourceVersion"))
        except Conflict as e:
            cause = f"conflict: {e.message or e.reason}"
            continue  # changed since we read it: decide again on the fresh Node
        except NotFound:
            return removed
        except KubeApiError as e:
            if not e.retryable:
                raise
            cause = f"{e.status} {e.reason}"
            time.sleep(backoff.failed())
            continue
        removed.extend(k for k in removal.keys if k not in removed)
    try:
        left = owned_on(get_node(api, node_name), keys, gfd_labels=gfd_labels)
    except NotFound:
        return removed
    if left:
        raise CleanupError(node_name, left.keys, cause)
    return removed


# --- opt-out: does the plugin's own Pod still belong on this Node? ---------------------------------------------


def own_pod(api: kubernetes.client.ApiClient, node_name: str, pod_name: str) -> dict[str, Any] | None:
    """The plugin's own Pod on this Node, by name (a listing by field: the plugin may list pods, not get them)."""
    items, _ = list_objects(api, "pods", field_selector=f"spec.nodeName={node_name},metadata.name={pod_name}")
    mine = [p for p in items if (p.get("metadata") or {}).get("name") == pod_name]
    return mine[0] if len(mine) == 1 else None


def leave_if_opted_out(api: kubernetes.client.ApiClient, node_name: str, keys: Keys,
                       pod_name: str | None) -> bool:
    """At the plugin's shutdown: remove our keys when its Node no longer selects its Pod (opt-in label removed,
    another device plugin chosen) -> True when removed. Anything unknown keeps them, said in the log."""
    if not pod_name:
        log.info("plugin.cleanup.kept", node=node_name, reason="own pod unknown (not in a pod, or POD_NAME unset)")
        return False
    try:
        pod = own_pod(api, node_name, pod_name)
        if pod is None:
            log.info("plugin.cleanup.kept", node=node_name, pod=pod_name, reason="own pod not found on this node")
            return False
        if pod_fits_node(pod, get_node(api, node_name)):
            log.info("plugin.cleanup.kept", node=node_name, pod=pod_name, reason="node still selects the plugin")
            return False
        removed = remove_published(api, node_name, keys)
    except NotFound:
        return False
    except (KubeApiError, CleanupError) as e:
        log.warning("plugin.cleanup.failed", node=node_name, error=str(e), action="keys left on the node")
        return False
    log.info("plugin.cleanup.done", node=node_name, why="node opted out", removed=removed)
    return True


def stop_leaver(api: kubernetes.client.ApiClient, node_name: str, keys: Keys,
                pod_name: str | None) -> Callable[[], None]:
    """The shutdown step for gpuplugin.publisher.Publication: run last, after the publisher stopped writing."""
    def leave() -> None:
        leave_if_opted_out(api, node_name, keys, pod_name)

    return leave
