"""A pod's NVLink and bandwidth floor as required node affinity, so node autoscalers see them.

The Cluster Autoscaler and Karpenter never call the extender: they re-run kube-scheduler's in-tree filters on
existing nodes and node-group templates (docs/reference/autoscaling.md, 1.2 and 2). A pod asking `require-nvlink`
that the extender refuses on PCIe servers looked to them as if it fitted there, so no NVLink node was ever added.
The plugin labels each node with its fabric and, per size k, the best all-reduce GB/s of k GPUs on the empty node
(gputopo.contract.Keys.allreduce_label); here the pod's annotations become required node affinity on those labels:

    require-nvlink            -> <prefix>/fabric In [nvswitch, nvlink], <prefix>/nvlink-ring-<k> NotIn [false]
    min-allreduce-gbps: X     -> <prefix>/allreduce-gbps-<k> Gt ceil(X) - 1     (k: the pod's GPU count)

A pod asking k replicas of a shared resource (time-slicing, MPS) needs k distinct GPUs with a free replica, which
the node's replica count does not say: the plugin labels each such node with how many GPUs have one
(`<prefix>/free-gpus.<resource>`, Keys.free_gpus_label), and the pod gets `Gt k-1` on it. That label follows the
pods, so kube-scheduler re-reads it at each attempt (and retries the pod when it changes), as autoscalers do.
It is an alternative, the label absent or `Gt k-1`: a node without the label is one whose plugin does not
publish it (a whole-GPU node where NVIDIA's time-slicing without renaming shares `nvidia.com/gpu` elsewhere, a
node of another plugin or of an older version of ours), where the extender alone decides, as before. Node
affinity has no OR inside a term, so each of the pod's terms becomes two, one per alternative.

A node whose sharing config sets NVIDIA's failRequestsGreaterThanOne refuses any container asking more than one
replica (the kubelet calls Allocate per container, init containers too), which its replica count does not say
either: the plugin labels it `<prefix>/one-replica-per-container.<resource>: "true"` (Keys.one_replica_label), and
a pod one of whose containers asks two or more replicas gets `DoesNotExist` on it, ANDed into every term like the
constraints above. Without it an autoscaler read such a node as fitting the pod ("can be moved to") and added none.

The fabric label says only that some NVLink exists; `nvlink-ring-<k>` says whether k GPUs of the empty node can
ring on NVLink alone (false for 4 GPUs of NVLink-bridge pairs), so an autoscaler never adds such a node for a pod
the extender refuses there for good. The bandwidth labels are integers rounded down, so a node whose best set is
within 1 GB/s above X is left out: the affinity never admits a node the extender would refuse for good. What it
cannot say is the node's current free set: on a node whose NVLink joins only some GPUs, the extender may still
refuse while the linked ones are busy.

Node affinity's terms are ORed and the expressions of a term ANDed, so the expressions are added to every term the
pod already has (or one term is made). An expression already there is not added twice (a pod re-created from a
template that went through here keeps its affinity).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from extender.state.pods import PodSpecError, constraints
from gputopo.contract import NVLINK_FABRICS, Keys

_AFFINITY = "/spec/affinity"
_NODE = "nodeAffinity"
_REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


def expressions(annotations: Mapping[str, Any], gpus: int, keys: Keys) -> list[dict[str, Any]]:
    """The node selector requirements the pod's constraint annotations mean for a pod of `gpus` whole GPUs (none
    for fewer than 2: a single GPU has no all-reduce). Raises PodSpecError on an unreadable annotation."""
    if gpus < 2:
        return []
    require_nvlink, min_gbps = constraints(annotations, keys)
    out: list[dict[str, Any]] = []
    if require_nvlink:
        out.append({"key": keys.fabric_label, "operator": "In", "values": list(NVLINK_FABRICS)})
        # NotIn also admits a node without the label (a plugin that predates it): the extender decides there
        out.append({"key": keys.nvlink_ring_label(gpus), "operator": "NotIn", "values": ["false"]})
    if min_gbps > 0:
        out.append({"key": keys.allreduce_label(gpus), "operator": "Gt", "values": [str(math.ceil(min_gbps) - 1)]})
    return out


def one_replica_expressions(largest: Mapping[str, int], keys: Keys) -> list[dict[str, Any]]:
    """`DoesNotExist` on Keys.one_replica_label of each replica name some container of the pod asks two or more of
    (`largest`: name -> the most one container asks; module docstring)."""
    out = []
    for name, most in sorted(largest.items()):
        key = keys.one_replica_label(name) if most >= 2 else None
        if key is not None:
            out.append({"key": key, "operator": "DoesNotExist"})
    return out


def either_replicas(counts: Mapping[str, int], keys: Keys) -> list[list[dict[str, Any]]]:
    """One pair of alternatives per replica name asked twice or more (module docstring); several names multiply
    out."""
    out: list[list[dict[str, Any]]] = [[]]
    for name, k in sorted(counts.items()):
        key = keys.free_gpus_label(name) if k >= 2 else None
        if key is not None:
            pair = ({"key": key, "operator": "DoesNotExist"}, {"key": key, "operator": "Gt", "values": [str(k - 1)]})
            out = [[*alt, e] for alt in out for e in pair]
    return out if out != [[]] else []


def affinity_patch(spec: Mapping[str, Any], exprs: list[dict[str, Any]],
                   either: list[list[dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """One JSONPatch operation setting the pod's required node terms to each of its terms (or one empty term) with
    `exprs` and, when `either` is given, one of its alternatives added (module docstring). None when nothing would
    change (an expression already there is not added twice; terms that carry the alternatives' labels already come
    from a template that went through here), or when the pod's affinity has a shape the API server would refuse."""
    alternatives = either or [[]]
    affinity = spec.get("affinity")
    node = affinity.get(_NODE) if isinstance(affinity, dict) else None
    required = node.get(_REQUIRED) if isinstance(node, dict) else None
    terms = required.get("nodeSelectorTerms") if isinstance(required, dict) else None
    if (affinity is not None and not isinstance(affinity, dict)) or (node is not None and not isinstance(node, dict)):
        return []
    if required is not None and (not isinstance(terms, list) or not terms
                                 or not all(isinstance(t, dict) for t in terms)):
        return []
    old = [dict(t) for t in terms] if terms else [{}]
    if any(not isinstance(t.get("matchExpressions", []), list) for t in old):
        return []
    keys = {e["key"] for alt in alternatives for e in alt}
    if any(isinstance(e, dict) and e.get("key") in keys for t in old for e in t.get("matchExpressions") or []):
        return []
    added = [[e for e in exprs if e not in (t.get("matchExpressions") or [])] for t in old]
    if not either and not any(added):
        return []
    new = [{**t, "matchExpressions": list(t.get("matchExpressions") or []) + more + alt}
           for t, more in zip(old, added, strict=True) for alt in alternatives]
    if affinity is None:
        return [{"op": "add", "path": _AFFINITY, "value": {_NODE: {_REQUIRED: {"nodeSelectorTerms": new}}}}]
    if node is None:
        return [{"op": "add", "path": f"{_AFFINITY}/{_NODE}", "value": {_REQUIRED: {"nodeSelectorTerms": new}}}]
    if required is None:
        return [{"op": "add", "path": f"{_AFFINITY}/{_NODE}/{_REQUIRED}", "value": {"nodeSelectorTerms": new}}]
    return [{"op": "add", "path": f"{_AFFINITY}/{_NODE}/{_REQUIRED}/nodeSelectorTerms", "value": new}]


def topology_affinity(pod: Mapping[str, Any], gpus: int, keys: Keys, replicas: Mapping[str, int] | None = None,
                      largest: Mapping[str, int] | None = None) -> tuple[list[dict[str, Any]], str | None]:
    """(patch operations, the problem when the annotations cannot be read) for a pod of `gpus` whole GPUs,
    `replicas` per name that is replicas on some nodes, and `largest`, per such name, the most any one of its
    containers asks. The extender refuses a pod with unreadable annotations in the same words; the webhook then adds
    only the replicas' requirements."""
    meta = pod.get("metadata")
    ann = meta.get("annotations") if isinstance(meta, dict) else None
    spec = pod.get("spec")
    if not isinstance(spec, dict):
        return [], None
    exprs: list[dict[str, Any]] = []
    problem = None
    try:
        exprs = expressions(ann if isinstance(ann, dict) else {}, gpus, keys)
    except PodSpecError as e:
        problem = str(e)
    exprs += one_replica_expressions(largest or {}, keys)
    return affinity_patch(spec, exprs, either_replicas(replicas or {}, keys)), problem
