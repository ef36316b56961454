"""`gpuplugin cleanup`: take the plugin's labels and annotations off Nodes, the last step of an uninstall.

Left on a Node, the autoscaler hold the plugin sets pins it for ever (gpuplugin.node_cleanup says what is removed
and what never is). The chart runs this as a pre-delete hook Job; kustomize users run it themselves:

    gpuplugin cleanup --all --daemonset gpu-topology/gpu-topology-plugin

`--daemonset` first moves the plugin's DaemonSet to no node and waits for its pods to end, so that no running
plugin writes its keys back between the cleanup and the DaemonSet's deletion (a plugin that stops on a node still
opted in keeps its keys: it cannot tell an uninstall from an upgrade). A DaemonSet already deleted is only waited
for: its pods may still be stopping.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import click
import structlog

from gputopo.contract import DEFAULT_PREFIX, Keys

log = structlog.get_logger(__name__)

DEFAULT_WAIT_S = 120.0
POLL_S = 1.0


class _ExitTwo(click.ClickException):
    exit_code = 2


def _daemonset_pods(api: Any, namespace: str, name: str) -> list[str]:
    from gputopo.kube.fetching import list_objects

    items, _ = list_objects(api, "pods", namespace=namespace)
    return [p["metadata"]["name"] for p in items
            if any(o.get("kind") == "DaemonSet" and o.get("name") == name
                   for o in (p.get("metadata") or {}).get("ownerReferences") or ())]


def stop_daemonset(api: Any, namespace: str, name: str, keys: Keys, wait_s: float) -> list[str]:
    """Select no node in the DaemonSet's pod template and wait until its pods are gone -> the pods still there
    after `wait_s` (a node that is down keeps its pod Terminating)."""
    import kubernetes.client

    from gputopo.kube.client import call_json, request_timeout
    from gputopo.kube.errors import NotFound
    from gputopo.kube.patching import MERGE_PATCH

    nowhere = {"spec": {"template": {"spec": {"nodeSelector": {f"{keys.prefix}/uninstalling": "true"}}}}}
    apps = kubernetes.client.AppsV1Api(api)
    try:
        call_json(f"patch daemonset {namespace}/{name}", apps.patch_namespaced_daemon_set, name, namespace, nowhere,
                  _content_type=MERGE_PATCH, _request_timeout=request_timeout(api))
        log.info("plugin.cleanup.daemonset_stopping", daemonset=f"{namespace}/{name}")
    except NotFound:
        pass  # deleted already (kustomize users may run this after `kubectl delete -k`): wait for its pods
    deadline = time.monotonic() + wait_s
    while True:
        left = _daemonset_pods(api, namespace, name)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(POLL_S)


def _node_names(api: Any, nodes: tuple[str, ...], every: bool, keys: Keys, gfd_labels: bool) -> list[str]:
    """The Nodes to clean: those named, or of all Nodes those the listing shows carrying keys of ours (each is
    read again before its patch; no plugin runs any more to add keys to the others)."""
    if not every:
        return list(nodes)
    from gpuplugin.node_cleanup import owned_on
    from gputopo.kube.fetching import list_objects

    items, _ = list_objects(api, "nodes")
    return sorted(n["metadata"]["name"] for n in items if owned_on(n, keys, gfd_labels=gfd_labels))


@click.command("cleanup")
@click.option("--node", "nodes", multiple=True, help="A Node to clean (repeatable).")
@click.option("--all", "every", is_flag=True, help="Every Node of the cluster.")
@click.option("--annotation-prefix", default=DEFAULT_PREFIX, show_default=True,
              help="The plugin's --annotation-prefix (prefix of its keys).")
@click.option("--gfd-labels", is_flag=True,
              help="Also remove the GPU Feature Discovery labels the plugin writes for sharing (nvidia.com/gpu."
                   "replicas, .sharing-strategy, .product, nvidia.com/mps.capable), on Nodes GFD does not label "
                   "(no nvidia.com/gfd.timestamp): where it does, they are GFD's and stay.")
@click.option("--daemonset", metavar="NAMESPACE/NAME",
              help="The plugin's DaemonSet: moved to no node and its pods waited for before cleaning.")
@click.option("--wait", "wait_s", type=click.FloatRange(min=0), default=DEFAULT_WAIT_S, show_default=True,
              help="Seconds to wait for the DaemonSet's pods to end.")
@click.option("--kubeconfig", type=click.Path(dir_okay=False), help="Kubeconfig file [default: in-cluster, "
              "then KUBECONFIG, then ~/.kube/config].")
def command(nodes: tuple[str, ...], every: bool, annotation_prefix: str, gfd_labels: bool, daemonset: str | None,
            wait_s: float, kubeconfig: str | None) -> None:
    """Remove the plugin's labels and annotations (and the autoscaler holds it set) from Nodes."""
    from gpuplugin.node_cleanup import CleanupError, remove_published
    from gputopo.kube.client import KubeConfigError, make_api_client
    from gputopo.kube.errors import KubeApiError
    from gputopo.logs import configure_logging

    configure_logging("info")
    if bool(nodes) == every:
        raise _ExitTwo("name the nodes (--node NAME, repeatable) or give --all, not both")
    try:
        keys = Keys(annotation_prefix)
    except ValueError as e:
        raise _ExitTwo(f"--annotation-prefix: {e}") from None
    namespace, _, ds_name = (daemonset or "").partition("/")
    if daemonset is not None and not (namespace and ds_name):
        raise _ExitTwo(f"--daemonset {daemonset!r}: expected NAMESPACE/NAME")
    try:
        api = make_api_client(kubeconfig=kubeconfig)
    except KubeConfigError as e:
        raise _ExitTwo(str(e)) from None
    failed = False
    try:
        if daemonset is not None:
            left = stop_daemonset(api, namespace, ds_name, keys, wait_s)
            if left:  # a node that is down keeps its pod Terminating for ever: that must not block an uninstall
                log.warning("plugin.cleanup.pods_left", daemonset=daemonset, pods=left, wait_s=wait_s)
                click.echo(f"warning: pods of {daemonset} still there after {wait_s:g}s: {', '.join(left)}; "
                           "cleaning anyway (a running one may write its keys back: run this again once they are "
                           "gone)", err=True)
        for name in _node_names(api, nodes, every, keys, gfd_labels):
            try:
                removed = remove_published(api, name, keys, gfd_labels=gfd_labels)
            except CleanupError as e:
                failed = True
                log.error("plugin.cleanup.failed", node=name, error=str(e))
                click.echo(f"error: {e}", err=True)
                continue
            if removed:
                log.info("plugin.cleanup.done", node=name, why="cleanup command", removed=removed)
                click.echo(f"{name}: removed {', '.join(removed)}")
    except KubeApiError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    finally:
        api.close()
    if failed:
        sys.exit(1)
